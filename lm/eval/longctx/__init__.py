"""Long-context probes generated locally: needles in haystacks and variable tracking (probes.py), over a grid
of lengths and depths (grid.py)."""
