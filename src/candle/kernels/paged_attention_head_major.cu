// Paged-attention decode over head-major blocks: the kernels of paged_attention.cuh, order 1.
#include "paged_attention.cuh"

PAGED_ATTENTION_MODULE(1)
