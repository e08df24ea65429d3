// Paged-attention decode over token-major blocks: the kernels of paged_attention.cuh, order 0.
#include "paged_attention.cuh"

PAGED_ATTENTION_MODULE(0)
