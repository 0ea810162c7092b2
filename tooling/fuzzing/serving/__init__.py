"""What the GPU fuzzer runs in other interpreters: on the GPU host, in the interpreter of
the vLLM under test (``python -m tooling.fuzzing.serving.gpu_run``, ``gpu_vet``); its
findings' float32 referee, in one with torch and transformers (``referee_model``)."""
