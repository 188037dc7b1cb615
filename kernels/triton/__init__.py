"""Triton backend of the draft step (fused skinny GEMMs, prelude, paged window attention); `ops.TRITON_OPS`."""
