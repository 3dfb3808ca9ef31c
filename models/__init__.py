"""stack.models: the multi-task BEV perception/planning network (plain nn.Modules, export-friendly)."""
