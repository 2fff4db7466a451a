// The Python module of the CPU kernels (loaded by kernels/cpu_ops.py).

#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor page_table, torch::Tensor query_start_loc,
                              torch::Tensor context_lens, double scale);
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal paged attention over a mixed batch (pages read in place)");
  m.def("store_kv", &store_kv, "scatter K/V rows into their cache slots");
  m.def("skinny_linear", &skinny_linear, "x W^T (+ b) for a few rows of x, streaming W once");
}
