// Paged-attention decode over split-K blocks: the kernels of paged_attention.cuh, order 2.
#include "paged_attention.cuh"

PAGED_ATTENTION_MODULE(2)
