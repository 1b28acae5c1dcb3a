"""OpenAI-compatible HTTP server around an engine client (twospeed/serving/): app.py (routes, errors, auth,
shutdown), prepare.py and protocol.py (requests to sequences), streaming.py and responses.py (the split clock and
bill, usage, logprobs as JSON), metrics.py (Prometheus), history.py (the dashboard)."""
