"""Action models, the comparator and response parsing of single_step_tool_use_with_argument_comparison."""
