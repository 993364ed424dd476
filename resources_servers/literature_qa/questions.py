"""The question pool of literature_qa, written for this project against ``data/corpus.jsonl``.

Each :class:`Question` is answered by the paper(s) in ``citations`` (``evidence``: text the generator
checks each of them holds, so a corpus edit cannot silently orphan a question), or, with ``answer``
None, by no paper: the corpus does not report it (another dose, another site, another quantity, a
number that was measured but not given), and the right answer is "insufficient information".
Numeric answers are positive: a question that could have a signed answer asks for a magnitude ("by how
much", "by what percentage did it fall"), and the sign of a submitted number counts (-9.8 is not 9.8). No
answer is one of its question's own numbers (those are read as context; the generator checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Question:
    question_id: str
    question: str
    answer: float | str | None  # a number; the right option's text (multiple choice); None: unanswerable
    citations: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()  # one substring per cited paper, in order
    distractors: tuple[str, ...] = ()  # multiple choice only: the wrong options
    tolerance: float = 0.01  # numeric only: relative
    kind: str = field(init=False, default="numeric")

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", "multiple_choice" if self.distractors else "numeric")


def _n(
    qid: str, question: str, answer: float, paper: str, evidence: str, tolerance: float = 0.01
) -> Question:
    return Question(qid, question, answer, (paper,), (evidence,), tolerance=tolerance)


def _mc(qid: str, question: str, right: str, wrong: tuple[str, ...], paper: str, evidence: str) -> Question:
    return Question(qid, question, right, (paper,), (evidence,), distractors=wrong)


def _none(qid: str, question: str, distractors: tuple[str, ...] = ()) -> Question:
    return Question(qid, question, None, distractors=distractors)


POOL: tuple[Question, ...] = (
    # Answerable, numeric.
    _n(
        "q01",
        "In the alpine gentian pollination study, what percentage of the seeds of open flowers did night-only flowers set?",
        41,
        "LQA-001",
        "Night-only flowers set 41 %",
    ),
    _n(
        "q02",
        "In roadside wood frog ponds, what was the mean chloride concentration in mg/L?",
        412,
        "LQA-002",
        "412 mg/L",
    ),
    _n(
        "q03",
        "How many times higher was August baseflow below beaver dam complexes than in undammed reaches?",
        2.7,
        "LQA-003",
        "2.7 times higher",
    ),
    _n(
        "q04",
        "What initial capacity (mAh/g at 0.1C) did the titanium-doped layered sodium manganese oxide cathode deliver?",
        186,
        "LQA-004",
        "186 mAh/g",
    ),
    _n(
        "q05",
        "Up to what crack width (mm) did mortar with encapsulated Bacillus spores heal completely?",
        0.46,
        "LQA-005",
        "Cracks up to 0.46 mm",
    ),
    _n(
        "q06",
        "What percentage of CA1 place cells showed significant theta phase precession in darkness?",
        58,
        "LQA-006",
        "71 % to 58 %",
    ),
    _n(
        "q07",
        "What was the correlation coefficient r between spindle density and overnight motor-sequence gains in older adults?",
        0.47,
        "LQA-007",
        "r = 0.47",
    ),
    _n(
        "q08",
        "What land equivalent ratio did the wheat-faba bean intercrop reach at 60 kg N/ha?",
        1.21,
        "LQA-008",
        "land equivalent ratio of 1.21",
    ),
    _n(
        "q09",
        "By what percentage did alternate wetting and drying reduce seasonal methane emissions from Mekong Delta rice?",
        48,
        "LQA-009",
        "by 48 %",
    ),
    _n(
        "q10",
        "At what rate (degrees C per decade) did the 200-500 m layer on the East Greenland shelf warm between 2004 and 2019?",
        0.31,
        "LQA-010",
        "0.31 C per decade",
    ),
    _n(
        "q11",
        "By what percentage did per-cell calcification of Emiliania huxleyi fall at 1,000 micro-atmospheres pCO2 in the Raunefjord mesocosms?",
        26,
        "LQA-011",
        "fell by 26 %",
    ),
    _n(
        "q12",
        "By how many log10 CFU per thigh did the phage cocktail combined with meropenem reduce carbapenem-resistant Klebsiella?",
        3.9,
        "LQA-012",
        "3.9 log10",
    ),
    _n(
        "q13",
        "How many hours after rewetting dry grassland soil did microbial respiration peak?",
        4.5,
        "LQA-013",
        "4.5 hours after rewetting",
    ),
    _n(
        "q14",
        "What mean percent body-weight change (magnitude) did 40 mg GX-417 produce over 26 weeks?",
        9.8,
        "LQA-014",
        "-9.8 % with 40 mg",
    ),
    _n(
        "q15",
        "What was the caffeine half-life in hours at 36 weeks of gestation?",
        10.7,
        "LQA-015",
        "10.7 hours at 36 weeks",
    ),
    _n(
        "q16",
        "What is the orbital period in days of the sub-Neptune Kessler-88 b?",
        23.71,
        "LQA-016",
        "23.71 days",
    ),
    _n(
        "q17",
        "What median rotation period (days) did solar-mass stars in NGC 2516 have?",
        6.8,
        "LQA-017",
        "median period of 6.8 days",
    ),
    _n(
        "q18",
        "What Holocene slip rate in mm per year was found for the Southern Karaoglu fault?",
        7.6,
        "LQA-018",
        "7.6 mm per year",
    ),
    _n(
        "q19",
        "What was the median erosion rate (mm per year) of the 19 Alaskan tidewater glaciers?",
        5.1,
        "LQA-019",
        "median of 5.1 mm per year",
    ),
    _n(
        "q20",
        "What methanol selectivity (%) did the best copper-mordenite catalyst reach at 200 C?",
        97,
        "LQA-020",
        "selectivity of 97 %",
    ),
    _n(
        "q21",
        "What enantiomeric excess (%) did the sulfonated BINAP-ruthenium catalyst give in water for methyl acetoacetate?",
        98.6,
        "LQA-021",
        "98.6 % enantiomeric excess",
    ),
    _n(
        "q22",
        "What was the asthma exacerbation rate ratio for active versus sham HEPA filters?",
        0.59,
        "LQA-022",
        "rate ratio of 0.59",
    ),
    _n(
        "q23",
        "What was the median lead time in days of the wastewater norovirus signal before the first clinical case?",
        5,
        "LQA-023",
        "median lead time was 5 days",
    ),
    _n(
        "q24",
        "What thermal conductivity in W/(m K) did isotopically pure 115 nm silicon nanowires have at 300 K?",
        46,
        "LQA-025",
        "46 W/(m K)",
    ),
    _n(
        "q25",
        "What was the purchase rate (%) of jam when online shoppers saw 24 varieties?",
        3.9,
        "LQA-026",
        "3.9 % with 24 options",
    ),
    _n(
        "q26",
        "What median foraging distance (m) did honeybees have in intensive cereal landscapes?",
        1490,
        "LQA-031",
        "1,490 m in intensive",
    ),
    _n(
        "q27",
        "By what percentage did lumbar spine bone density rise with high-intensity resistance training in women with osteopenia?",
        2.9,
        "LQA-032",
        "rose by 2.9 %",
    ),
    _n(
        "q28",
        "What was the maximum urban-rural night temperature difference (degrees C) measured by bicycle in Rotterdam?",
        7.8,
        "LQA-029",
        "difference was 7.8 C",
    ),
    # Answerable, multiple choice.
    _mc(
        "q29",
        "Which polymer was most common among microplastics in Atlantic mackerel off western Ireland?",
        "polyethylene terephthalate",
        ("polypropylene", "polystyrene", "low-density polyethylene"),
        "LQA-033",
        "polyethylene terephthalate was the most common",
    ),
    _mc(
        "q30",
        "Which animals made most of the nocturnal visits to alpine gentian flowers?",
        "noctuid moths",
        ("bumblebees", "hoverflies", "geometrid moths"),
        "LQA-001",
        "Noctuid moths made 78 %",
    ),
    _mc(
        "q31",
        "What did the online grocery field experiment conclude about choice overload?",
        "the effect did not replicate online",
        (
            "24 options halved purchases",
            "6 options lowered satisfaction",
            "24 options raised purchases by a third",
        ),
        "LQA-026",
        "did not replicate online",
    ),
    _mc(
        "q32",
        "What trend in Weddell Sea ice thickness did ship-based electromagnetic sounding find over 2010-2020?",
        "no significant trend",
        ("thinning of 10 cm per decade", "thickening of 10 cm per decade", "a doubling of deformed ice"),
        "LQA-030",
        "No significant trend",
    ),
    # Answerable from two papers.
    Question(
        "q33",
        "How many percentage points higher was the nausea rate on 40 mg GX-417 than the discontinuation rate for adverse events on the same dose?",
        27,
        ("LQA-014",),
        ("Nausea occurred in 34 %",),
    ),
    Question(
        "q34",
        "Which was larger: the reduction in irrigation water under alternate wetting and drying in Mekong rice, or the increase in olive yield with treated wastewater in Sfax? Give the larger value in percent.",
        27,
        ("LQA-009", "LQA-028"),
        ("irrigation water by 27 %", "14 % higher"),
    ),
    # Not answerable from the corpus.
    _none("q35", "What percent body-weight change did an 80 mg dose of GX-417 produce over 26 weeks?"),
    _none("q36", "What is the orbital period in days of Kessler-88 c?"),
    _none("q37", "What slip rate in mm per year was measured for the Northern Karaoglu fault?"),
    _none(
        "q38",
        "By what percentage did alternate wetting and drying change nitrous oxide emissions from Mekong Delta rice?",
    ),
    _none(
        "q39",
        "What was the median erosion rate (mm per year) of Greenland tidewater glaciers estimated from fjord sediment?",
    ),
    _none("q40", "What was the thermal conductivity at 300 K of isotopically pure germanium nanowires?"),
    _none("q41", "What fraction of mackerel caught off Norway contained microplastics?"),
    _none("q42", "What was the caffeine half-life in hours at 14 weeks of gestation?"),
    _none(
        "q43",
        "How many spindles per minute did the older adults in the motor-sequence study have on average?",
    ),
    _none(
        "q44",
        "Which co-catalyst gave the highest hydrogen evolution in a comparison of co-catalysts on the 1 m2 aluminium-doped SrTiO3 panel?",
        ("Rh/Cr2O3", "CoOOH", "Pt", "NiO"),
    ),
)
