"""The simulator: iterserve's real scheduler, block manager and server over a model runner
that produces tokens without a model and takes as long as a latency profile predicts.

No torch here (the control-plane image runs simulated replicas). Modules: ``profile``
(latency profiles), ``runner`` (the simulated model runner), ``tokenizer`` (tokenizers that
need neither torch nor transformers), ``replica`` (``iterserve serve --simulate``),
``replay`` (``iterserve simulate``: what-if replay in virtual time), ``front`` (a replica's
HTTP front in the replay), ``result`` (a replay's records and report), ``simulate`` (the
command), ``fit`` (the profile's least-squares fit, for ``bench calibrate``).
"""
