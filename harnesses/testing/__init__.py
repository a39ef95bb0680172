"""What tests and measures the harnesses, never imported by a run against a real endpoint: the scripted
model (an OpenAI-compatible server playing scripts, also the ``scripted`` provider of demos) and the
conformance scenarios with their checks."""
