"""The parts of `moelens.model`'s wrapped model and of `wrap`, one job a module.

`inputs` (a trace's ids, masks, cache and padding), `refusals` (a model moelens cannot run as it is), `run_errors`
(the moelens error for a failed run's bare one), `envoys` (which envoy each module gets, the standard names),
`instrument` (the blocks' ops, instrumented at wrap), `instance_state` (nnsight's state on the modules, undone on a
refused wrap), `pipeline` (nnsight's transformers pipeline), `walk` (the modules each trace checks), `generation`
(``generate``'s settings).
"""
