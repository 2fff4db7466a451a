// A step's decoder layers in one call, for steps whose every product takes the packed GEMV
// (decode steps and speculative verifies: a few rows). Called by engine/model/fused_decode.py
// from LlamaForCausalLM.forward_stage in place of the Python loop over layers.
//
// Each layer runs exactly the kernels the Python loop calls, in the same order and on the same
// tensors (add_rms_norm_, packed_gemv, rotary_, store_kv, paged_attention, silu_mul), so the
// result is bit-identical; only the Python between them is gone. Why: at batch 1 on 2 cores a
// 12-layer builtin:small forward took ~12.8 ms of which the kernels were ~9.5; the rest was
// Python dispatch and argument checks between ~10 calls a layer (~250 us a layer).

#include <ATen/ATen.h>

#include <vector>

void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin, int64_t num_rotated_heads);
at::Tensor silu_mul(at::Tensor gate_up);
void store_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping);
at::Tensor paged_attention(at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor page_table,
                           at::Tensor query_start_loc, at::Tensor context_lens, double scale);
at::Tensor packed_gemv(at::Tensor x, at::Tensor blocked, int64_t n, c10::optional<at::Tensor> bias, int64_t block_n,
                       int64_t block_k);

namespace {

bool has(const at::Tensor& bias) { return bias.defined() && bias.numel() > 0; }

// Weights of one kind (qkv, o, gate_up or down) across the layers, as kernels/packed_linear.py's
// PackedGemv holds them: the blocked bytes, outputs, block shape; a bias, or an empty tensor for
// none (a Python list of tensors cannot hold None).
struct Products {
  const std::vector<at::Tensor>& blocked;
  const std::vector<at::Tensor>& bias;
  const std::vector<int64_t>& shape;  // per layer: n, block_n, block_k

  at::Tensor operator()(size_t layer, const at::Tensor& x) const {
    const int64_t* s = shape.data() + 3 * layer;
    const at::Tensor& b = bias[layer];
    return packed_gemv(x, blocked[layer], s[0], has(b) ? c10::optional<at::Tensor>(b) : c10::nullopt, s[1], s[2]);
  }
};

}  // namespace

// hidden [T, H]: layer 0's input already normed (its first norm has no residual to add, which
// the caller does as LlamaForCausalLM does); residual [T, H], added into in place. Returns the
// last layer's MLP output (the caller adds the residual). Per layer l: norms[2l], norms[2l + 1]
// (input, post-attention), caches[2l], caches[2l + 1] (K, V); `o_bias` is added after the
// product, as RowParallelLinear does.
at::Tensor decode_layers(at::Tensor hidden, at::Tensor residual, std::vector<at::Tensor> norms, double eps,
                         std::vector<at::Tensor> qkv_w, std::vector<at::Tensor> qkv_bias, std::vector<int64_t> qkv_shape,
                         std::vector<at::Tensor> o_w, std::vector<at::Tensor> o_bias, std::vector<int64_t> o_shape,
                         std::vector<at::Tensor> gate_up_w, std::vector<int64_t> gate_up_shape,
                         std::vector<at::Tensor> down_w, std::vector<int64_t> down_shape,
                         std::vector<at::Tensor> caches, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double scale, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                         at::Tensor page_table, at::Tensor query_start_loc, at::Tensor context_lens) {
  const size_t layers = qkv_w.size();
  const std::vector<at::Tensor> none(layers);
  TORCH_CHECK(norms.size() == 2 * layers && caches.size() == 2 * layers && qkv_bias.size() == layers &&
                  o_w.size() == layers && o_bias.size() == layers && gate_up_w.size() == layers &&
                  down_w.size() == layers && qkv_shape.size() == 3 * layers && o_shape.size() == 3 * layers &&
                  gate_up_shape.size() == 3 * layers && down_shape.size() == 3 * layers,
              "decode_layers: every per-layer list must cover the same ", layers, " layers");
  const Products qkv{qkv_w, qkv_bias, qkv_shape}, o{o_w, none, o_shape}, gate_up{gate_up_w, none, gate_up_shape},
      down{down_w, none, down_shape};
  const int64_t tokens = hidden.size(0), h = num_heads, kv = num_kv_heads;
  at::Tensor x = hidden;
  for (size_t l = 0; l < layers; ++l) {
    if (l > 0) add_rms_norm_(x, residual, norms[2 * l], eps);
    const at::Tensor q_k_v = qkv(l, x).view({tokens, h + 2 * kv, head_dim});
    rotary_(q_k_v, positions, cos, sin, h + kv);  // queries and keys, in place
    store_kv(q_k_v.slice(1, h, h + kv), q_k_v.slice(1, h + kv), caches[2 * l], caches[2 * l + 1], slot_mapping);
    const at::Tensor attn = paged_attention(q_k_v.slice(1, 0, h), caches[2 * l], caches[2 * l + 1], page_table,
                                            query_start_loc, context_lens, scale);
    at::Tensor out = o(l, attn.reshape({tokens, h * head_dim}));
    if (has(o_bias[l])) out = out + o_bias[l];
    add_rms_norm_(out, residual, norms[2 * l + 1], eps);
    x = down(l, silu_mul(gate_up(l, out)));
  }
  return x;
}
