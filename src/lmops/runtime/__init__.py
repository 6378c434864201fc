"""What serving needs: the network, the tokenizer runtime, quantization, the model directory and the
inference engine. Never imports lmops.pipeline (tests/unit/test_layers.py).
"""
