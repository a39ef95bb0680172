"""What tests and measures the executor, loaded only by the commands that need it: the conformance
runner (``rollout conformance``) and the benchmarks (``rollout bench``)."""
