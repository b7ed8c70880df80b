"""The Triton kernels' limits, in plain Python (no Triton import): read by the kernels, the dispatch and the tests."""

MAX_FEATURE = 16384  # a row kernel keeps one feature row in registers
MAX_HEAD_DIM = 128  # attention keeps a [block, head dim] tile of Q, K and V
MAX_SEQLEN_DROPOUT = 46340  # attention dropout: row * max_seqlen + col must fit the int32 Philox offset
