"""Training: `layout` builds everything static about a run (a pure function of the model's
abstract state, the config, the mesh and `EngineOptions`), `step` is the one jitted step,
`memory` is the compiled step's peak and the guard run before the first step, and `engine`
executes a layout (init, step, eval, save, load)."""
