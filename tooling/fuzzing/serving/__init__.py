"""What the GPU fuzzer runs on the GPU host, in the interpreter of the vLLM under test
(``python -m tooling.fuzzing.serving.gpu_run``)."""
