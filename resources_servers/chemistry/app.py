"""chemistry: molecule answers as SMILES, checked by rdkit (ether0's reward ideas, written here).

Contract
--------
* Row fields: ``task_id``, ``task`` (one of six task types, told apart by ``task.task_type``; each
  carries its parameters and what the check needs) and ``responses_create_params`` (the question; never
  the reference):

  - ``fragment_completion``: ``fragment`` (SMILES), ``constraints`` ({descriptor: {min, max}}),
    ``reference_answer``. Any molecule containing the fragment (substructure), with more heavy atoms than
    the fragment, within the bounds passes (the fragment itself is ``unchanged``).
  - ``formula_design``: ``formula`` (neutral, e.g. ``C3H6O2``), ``groups`` ({name: SMARTS}),
    ``reference_answer``. The molecule's formula (hydrogens included) equals it and every SMARTS matches.
  - ``reaction_product``: ``reactants``, ``conditions``, ``product``. The answer is the same molecule as
    ``product`` (stereo-free canonical SMILES, or standard InChIKey).
  - ``name_to_smiles``: ``name``, ``smiles``. Compared as for a product.
  - ``logp_edit``: ``smiles``, ``direction`` (up/down), ``min_change``, ``min_similarity``,
    ``reference_answer``. rdkit Crippen logP moves by at least ``min_change`` that way and the Tanimoto
    similarity (Morgan radius 2, 2048 bits) to ``smiles`` stays at least ``min_similarity``.
  - ``property_mcq``: ``property`` (a descriptor of ``chem.DESCRIPTORS``), ``extreme`` (max/min),
    ``options`` ({letter: SMILES}), ``answer`` (the letter). The answer is that letter.

  A row with a broken reference (a SMILES/SMARTS/formula that does not parse, a stored MCQ answer that
  is not the extreme option, a reference answer that fails its own task) is refused with a 422 naming the
  field, at ``/seed_session`` (before the model runs) and at ``/verify``: never a reward.
  Every SMILES answer must first be ONE connected, neutral, closed-shell molecule: disconnected parts (a
  salt, a solvent, a second molecule), a net charge or unpaired electrons are refused (``mixture``,
  ``charged``, ``radical``, the parts / charge / electrons in ``reason``), on every task type and on the
  row's own reference.
* The answer is the text inside the ``<answer>...</answer>`` tags (ASCII case-insensitive) of the
  assistant's messages (never a reasoning item), stripped of whitespace and of backticks around it, read
  in one pass: ONE answer (written once or the same way each time; empty tags ignored). Two or more
  different answers are ``several_answers`` (0). No tools: one model turn. Past ``MAX_ANSWER_CHARS`` the
  answer is refused unparsed.
* ``/verify`` (stateless) runs rdkit in the verify pool. Reward 1.0 iff ``failure_reason`` is ``pass``;
  else 0.0 with the reason: ``no_answer``, ``several_answers``, ``invalid_smiles`` (``reason`` has
  rdkit's complaint: syntax, valence, kekulization), ``mixture``, ``charged``, ``radical``,
  ``missing_fragment``, ``constraint_failed``, ``wrong_formula``, ``missing_group``, ``wrong_product``,
  ``wrong_molecule``, ``unchanged``, ``too_little_change``, ``too_dissimilar``, ``not_a_choice``,
  ``wrong_choice``. Metrics: ``task_type``, ``valid_smiles``
  (None for an MCQ or a missing answer), ``answer``, ``reason``, ``measured`` (descriptor values,
  ``logp_change``, ``similarity``); ``POST /aggregate_metrics`` (``compute_metrics``) gives the reward and the valid-SMILES
  rate per type.
* A verify-pool timeout or crash is an HTTP 503 (never a 0). The row check runs once per distinct task
  (remembered, ``checked_rows_cache`` rows); a response without an answer needs no pool trip.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from fastapi import HTTPException
from pydantic import BaseModel, Field, PrivateAttr

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.kit.verify_pool import get_verify_pool, run_in_verify_pool
from resources_servers.chemistry.chem import (
    MAX_ANSWER_CHARS,
    check_task,
    judge,
    no_answer,
    several_answers,
    warm_up_worker,
)

Descriptor = Literal[
    "mol_weight", "heavy_atoms", "rings", "aromatic_rings", "hbd", "hba", "logp", "rotatable_bonds", "tpsa"
]
TASK_TYPES = (
    "fragment_completion",
    "formula_design",
    "reaction_product",
    "name_to_smiles",
    "logp_edit",
    "property_mcq",
)
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


class ChemistryConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS  # verify reads the row and the response
    verify_timeout_seconds: float = Field(default=30, gt=0)
    # Rows already checked (their task JSON -> the problem found, or None): a row is checked in the pool
    # once, not at every /seed_session and /verify of its rollouts. 0 turns the memory off.
    checked_rows_cache: int = Field(default=20_000, ge=0)


class Bounds(BaseModel):
    min: float | None = None
    max: float | None = None


class FragmentTask(BaseModel):
    task_type: Literal["fragment_completion"]
    fragment: str
    constraints: dict[Descriptor, Bounds] = Field(default_factory=dict)
    reference_answer: str


class FormulaTask(BaseModel):
    task_type: Literal["formula_design"]
    formula: str
    groups: dict[str, str] = Field(min_length=1, description="functional group name -> SMARTS")
    reference_answer: str


class ReactionTask(BaseModel):
    task_type: Literal["reaction_product"]
    reactants: list[str] = Field(min_length=1)
    conditions: str = ""
    product: str


class NameTask(BaseModel):
    task_type: Literal["name_to_smiles"]
    name: str
    smiles: str


class LogPEditTask(BaseModel):
    task_type: Literal["logp_edit"]
    smiles: str
    direction: Literal["up", "down"]
    min_change: float = Field(gt=0)
    min_similarity: float = Field(ge=0, le=1)
    reference_answer: str


class ChoiceTask(BaseModel):
    task_type: Literal["property_mcq"]
    property: Descriptor
    extreme: Literal["max", "min"]
    options: dict[str, str] = Field(min_length=2)
    answer: str


Task = Annotated[
    FragmentTask | FormulaTask | ReactionTask | NameTask | LogPEditTask | ChoiceTask,
    Field(discriminator="task_type"),
]


class ChemistryRow(BaseModel):
    task_id: str = ""
    task: Task


class ChemistrySeedSessionRequest(ChemistryRow, BaseSeedSessionRequest):
    pass


class ChemistryVerifyRequest(ChemistryRow, BaseVerifyRequest):
    pass


class ChemistryVerifyResponse(ChemistryVerifyRequest, BaseVerifyResponse):
    task_type: str
    failure_reason: str
    valid_smiles: bool | None
    answer: str | None
    reason: str
    measured: dict[str, float]


def extract_answers(text: str, limit: int = 3) -> list[str] | None:
    """The different answers of ``text``: the content of each ``<answer>...</answer>`` (the tag in any ASCII
    case), stripped of whitespace and backticks, in order, each once, empty ones left out (``[""]`` when
    every tag is empty); None when there is no tag. Stops at ``limit`` different answers. One pass from
    left to right, so a reply of any length costs its length (a regex that rescanned the rest of the text
    at each opening tag took hours on megabytes of them)."""
    low = text.translate(_ASCII_LOWER)  # ASCII only: the same length, so the indices hold for ``text``
    found: dict[str, None] = {}
    tagged, position = False, 0
    while len(found) < limit:
        start = low.find("<answer>", position)
        if start < 0:
            break
        end = low.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        tagged, position = True, end + len("</answer>")
        answer = text[start + len("<answer>") : end].strip().strip("`").strip()
        if answer:
            found[answer] = None
    if not tagged:
        return None
    return list(found) or [""]


def metrics_by_type(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task type: mean reward, rollouts, and the rate of answers that parsed as SMILES (among the
    rollouts that gave a SMILES answer), so a weak type is visible under a good overall mean."""
    out: dict[str, Any] = {}
    for kind in TASK_TYPES:
        mine = [r for r in rollouts if r.get("task_type") == kind]
        if not mine:
            continue
        out[f"{kind}/reward"] = sum(float(r.get("reward", 0.0)) for r in mine) / len(mine)
        out[f"{kind}/rollouts"] = len(mine)
        judged = [bool(r["valid_smiles"]) for r in mine if r.get("valid_smiles") is not None]
        if judged:
            out[f"{kind}/valid_smiles"] = sum(judged) / len(judged)
    return out


class ChemistryServer(SimpleResourcesServer):
    config: ChemistryConfig
    _checked: dict[str, str | None] = PrivateAttr(default_factory=dict)

    async def on_startup(self) -> None:
        await super().on_startup()
        get_verify_pool().warm_up(warm_up_worker, timeout=300)

    async def _refuse_broken(self, task: BaseModel) -> None:
        """422 naming the field when the row's task is broken; each distinct task is checked once."""
        key = task.model_dump_json()
        if key in self._checked:
            problem = self._checked[key]
        else:
            problem = await run_in_verify_pool(
                check_task, task.model_dump(), timeout=self.config.verify_timeout_seconds
            )
            if self.config.checked_rows_cache:
                self._checked[key] = problem
                while len(self._checked) > self.config.checked_rows_cache:
                    del self._checked[next(iter(self._checked))]
        if problem:
            raise HTTPException(422, f"bad row: {problem}")

    async def seed_session(self, body: ChemistrySeedSessionRequest) -> BaseSeedSessionResponse:
        await self._refuse_broken(body.task)  # before the model spends a turn on it
        return BaseSeedSessionResponse()

    async def verify(self, body: ChemistryVerifyRequest) -> ChemistryVerifyResponse:
        await self._refuse_broken(body.task)  # a broken row is a 422, never a reward
        text = "".join(
            part.text
            for item in body.response.output
            if item.type == "message"
            for part in item.content
            if part.type == "output_text"
        )
        answers = extract_answers(text)
        answer = answers[0] if answers and len(answers) == 1 else None
        if answers is None:
            outcome = no_answer()
        elif answer is None:
            outcome = several_answers(answers)
        else:
            # An answer past the length bound is refused unparsed, so its first bound+1 characters are
            # enough to refuse it (and a 10 MB answer never goes through the pool's pipe).
            outcome = await run_in_verify_pool(
                judge,
                body.task.model_dump(),
                answer[: MAX_ANSWER_CHARS + 1],
                True,
                timeout=self.config.verify_timeout_seconds,
            )
        if "bad_row" in outcome:
            raise HTTPException(422, f"bad row: {outcome['bad_row']}")
        return ChemistryVerifyResponse.from_request(
            body,
            reward=1.0 if outcome["failure_reason"] == "pass" else 0.0,
            task_type=body.task.task_type,
            answer=answer,
            **outcome,
        )

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return metrics_by_type([r for rs in tasks for r in rs])

    def get_key_metrics(self, agent_metrics: dict[str, Any]) -> dict[str, Any]:
        """The mean reward, and the reward of each task type."""
        return {k: v for k, v in agent_metrics.items() if k.startswith("mean/") or k.endswith("/reward")}


if __name__ == "__main__":
    ChemistryServer.run_webserver()
