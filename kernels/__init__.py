"""Kernel backends of the draft step: pure-torch reference ops, Triton (GPU) and FlyDSL (gfx950)."""
