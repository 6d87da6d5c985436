"""lm.ops.kda's per-channel weights by halves (lm.ops.kda._pairwise_tree) at every kind of split of the chunk into
sub-chunks: a power of two of them or not (halves of unequal size), of one step each (the undecayed diagonal) or of
several, and the chunk a single sub-chunk; against tests/test_op_kda.py's float64 reference, with gradients."""

import pytest
from op_checks import check_reference
from test_op_kda import OP, SCALE, make_inputs

from lm.ops import kda

T = 37  # several chunks at every chunk size below, the last one padded


@pytest.mark.parametrize("variant", ["kda", "gdn2"])
@pytest.mark.parametrize("chunk_size,sub_chunk", [(8, 1), (12, 1), (20, 4), (24, 4), (28, 4), (6, 3), (5, 5)],
                         ids=lambda x: str(x))
def test_every_split_matches_the_reference_with_gradients(chunk_size, sub_chunk, variant):
    def chunkwise(x):
        return kda(x["q"], x["k"], x["v"], x["log_alpha"], x.get("beta"), SCALE, erase=x.get("erase"),
                   write=x.get("write"), initial_state=x["initial_state"], chunk_size=chunk_size,
                   sub_chunk=sub_chunk, backend="torch")

    check_reference(OP, chunkwise, make_inputs(T, variant=variant, requires_grad=True), 1e-10, grad_tol=1e-10)
