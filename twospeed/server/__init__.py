"""OpenAI-compatible HTTP server around LLMEngine: app.py (routes, errors, auth, streaming, shutdown),
protocol.py (request models), responses.py (the split clock and bill, usage, logprobs as JSON),
async_engine.py (the engine thread), metrics.py (Prometheus), slo.py (lanes and SLOs)."""
