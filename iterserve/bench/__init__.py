"""``iterserve bench``: what users run against their own deployment: ``serve`` (the streaming
load generator), ``gate`` (the regression gate), ``offline`` (against Hugging Face baselines),
``calibrate`` (a latency profile for the simulator) and ``fidelity`` (simulator vs server).
One-off studies live in the checkout's ``benchmarks/``, outside the package."""
