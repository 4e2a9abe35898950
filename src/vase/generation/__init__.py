"""Decoding with an evicting cache: vase.generate and teacher forcing (generate.py), prefill and
sampling (decoding.py), the batch loop (batched.py) and the compiled decode loop (compiled.py)."""
