// The Python module of the CPU kernels (loaded by kernels/cpu_ops.py).

#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor page_table, torch::Tensor query_start_loc,
                              torch::Tensor context_lens, double scale);
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void rotary_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t num_rotated_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
bool packed_gemv_supported();
bool int8_gemv_supported();
bool amx_attention_supported();
bool shared_prefix_attention_supported();
bool packed_gemv_amx_supported();
torch::Tensor packed_gemv(torch::Tensor x, torch::Tensor blocked, int64_t n, c10::optional<torch::Tensor> bias,
                          int64_t block_n, int64_t block_k);
torch::Tensor decode_layers(torch::Tensor hidden, torch::Tensor residual, std::vector<torch::Tensor> norms, double eps,
                            std::vector<torch::Tensor> qkv_w, std::vector<torch::Tensor> qkv_bias,
                            std::vector<int64_t> qkv_shape, std::vector<torch::Tensor> o_w,
                            std::vector<torch::Tensor> o_bias, std::vector<int64_t> o_shape,
                            std::vector<torch::Tensor> gate_up_w, std::vector<int64_t> gate_up_shape,
                            std::vector<torch::Tensor> down_w, std::vector<int64_t> down_shape,
                            std::vector<torch::Tensor> caches, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, double scale, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor slot_mapping, torch::Tensor page_table,
                            torch::Tensor query_start_loc, torch::Tensor context_lens);
torch::Tensor greedy_steps(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor num_fed,
                           torch::Tensor page_table, torch::Tensor num_steps, int64_t page_size, torch::Tensor embedding,
                           torch::Tensor first_norm, torch::Tensor final_norm, std::vector<torch::Tensor> norms,
                           double eps, std::vector<torch::Tensor> qkv_w, std::vector<torch::Tensor> qkv_bias,
                           std::vector<int64_t> qkv_shape, std::vector<torch::Tensor> o_w,
                           std::vector<torch::Tensor> o_bias, std::vector<int64_t> o_shape,
                           std::vector<torch::Tensor> gate_up_w, std::vector<int64_t> gate_up_shape,
                           std::vector<torch::Tensor> down_w, std::vector<int64_t> down_shape,
                           std::vector<torch::Tensor> caches, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, double scale, torch::Tensor cos, torch::Tensor sin, torch::Tensor head,
                           int64_t head_n, int64_t head_block_n, int64_t head_block_k);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal paged attention over a mixed batch (pages read in place)");
  m.def("store_kv", &store_kv, "scatter K/V rows into their cache slots");
  m.def("skinny_linear", &skinny_linear, "x W^T (+ b) for a few rows of x, streaming W once");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * weight, in place");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight in add_rms_norm_'s formula, without the residual");
  m.def("rotary_", &rotary_, "rotate the first num_rotated_heads heads of each qkv row by its position, in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [gate | up] row");
  m.def("packed_gemv_supported", &packed_gemv_supported, "whether packed_gemv was built (AVX512-BF16)");
  m.def("int8_gemv_supported", &int8_gemv_supported, "whether packed_gemv takes int8 weights (AVX512-VNNI and AVX512-BF16)");
  m.def("amx_attention_supported", &amx_attention_supported, "whether bf16 prefill tiles run on AMX (built with AMX, and the OS grants it)");
  m.def("shared_prefix_attention_supported", &shared_prefix_attention_supported, "whether bf16 decodes sharing cached prefix pages are attended as one group (AVX512-BF16 or AMX)");
  m.def("packed_gemv_amx_supported", &packed_gemv_amx_supported, "whether packed_gemv multiplies 2-32 rows on AMX tiles (32 x 32 layout)");
  m.def("decode_layers", &decode_layers, "a step's decoder layers over packed GEMVs in one call (engine/model/fused_decode.py)");
  m.def("greedy_steps", &greedy_steps, "a draft's greedy proposal in one call: its catch-up tokens, then steps each feeding the last argmax (engine/spec/fused_draft.py)");
  m.def("packed_gemv", &packed_gemv, "x W^T (+ b) for 1-8 bf16 rows, W read in oneDNN's bf16 block layout (block_n outputs x block_k inputs)");
}
