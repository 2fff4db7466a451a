// A draft model's greedy follow-up steps in one call: each step embeds the previous step's
// argmax, runs the decoder layers (decode_layers.cpp), the final norm, the output projection
// and the argmax, for as many steps as each row asks. Called by engine/spec/fused_draft.py for
// engine/spec/draft_proposer.py's k - 1 guesses fed back after its catch-up step.
//
// Each step is what LlamaForCausalLM.forward + ModelRunner.logits + argmax do for a batch of
// one-token decodes (engine/spec/draft_decode.py's batch: same slots, positions and context
// lengths), with the same kernels in the same order: embedding, RMSNorm's float32 formula,
// decode_layers, the residual add, RMSNorm again, the packed GEMV (or the skinny kernel for a
// draft head cut to the first token ids), argmax. So the guesses, and the KV written for them,
// are the Python loop's. Why: a draft is small (builtin:code-draft's two layers take well under
// a millisecond of kernels a step) and its guesses are only worth their cost when a step costs
// far less than a target step, so the Python around each step (building the batch, the module
// calls, the argmax's round trip) was most of it.

#include <ATen/ATen.h>

#include <vector>

at::Tensor decode_layers(at::Tensor hidden, at::Tensor residual, std::vector<at::Tensor> norms, double eps,
                         std::vector<at::Tensor> qkv_w, std::vector<at::Tensor> qkv_bias, std::vector<int64_t> qkv_shape,
                         std::vector<at::Tensor> o_w, std::vector<at::Tensor> o_bias, std::vector<int64_t> o_shape,
                         std::vector<at::Tensor> gate_up_w, std::vector<int64_t> gate_up_shape,
                         std::vector<at::Tensor> down_w, std::vector<int64_t> down_shape,
                         std::vector<at::Tensor> caches, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double scale, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                         at::Tensor page_table, at::Tensor query_start_loc, at::Tensor context_lens);
at::Tensor packed_gemv(at::Tensor x, at::Tensor blocked, int64_t n, c10::optional<at::Tensor> bias, int64_t block_n,
                       int64_t block_k);
at::Tensor skinny_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);

namespace {

// RMSNorm.forward (engine/model/layers.py): normalised in float32 whatever the dtype, then
// scaled by the weight after rounding back.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const std::vector<int64_t> shape{x.size(-1)};
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, shape, weight, eps);
  return weight * at::rms_norm(x.to(at::kFloat), shape, c10::nullopt, eps).to(x.scalar_type());
}

}  // namespace

// input_ids, positions [S] int64: each row's token to feed and its position (its KV slot's);
// page_table [S, P] int32 (pages already held through the last step's position); num_steps [S]
// int64 >= 1: the steps (guesses) each row takes, a row leaving the batch after its last.
// embedding [V, H]; first_norm: layer 0's input norm, final_norm the model's; then the layers as
// decode_layers takes them (norms .. scale), the rotary tables, and the output projection:
// packed (head_block_n > 0: oneDNN's blocks, head_n outputs) or a plain [head_n, H] weight.
// Returns the guesses [max steps, S] int64, -1 past a row's last step.
at::Tensor greedy_steps(at::Tensor input_ids, at::Tensor positions, at::Tensor page_table, at::Tensor num_steps,
                        int64_t page_size, at::Tensor embedding, at::Tensor first_norm, at::Tensor final_norm,
                        std::vector<at::Tensor> norms, double eps, std::vector<at::Tensor> qkv_w,
                        std::vector<at::Tensor> qkv_bias, std::vector<int64_t> qkv_shape, std::vector<at::Tensor> o_w,
                        std::vector<at::Tensor> o_bias, std::vector<int64_t> o_shape,
                        std::vector<at::Tensor> gate_up_w, std::vector<int64_t> gate_up_shape,
                        std::vector<at::Tensor> down_w, std::vector<int64_t> down_shape,
                        std::vector<at::Tensor> caches, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        double scale, at::Tensor cos, at::Tensor sin, at::Tensor head, int64_t head_n,
                        int64_t head_block_n, int64_t head_block_k) {
  const int64_t rows = input_ids.size(0);
  TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes() && num_steps.sizes() == input_ids.sizes(),
              "greedy_steps: input_ids, positions and num_steps must be [num_seqs]");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == rows && page_table.scalar_type() == at::kInt,
              "greedy_steps: page_table must be [num_seqs, max_pages] int32");
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  num_steps.scalar_type() == at::kLong,
              "greedy_steps: input_ids, positions and num_steps must be int64");
  const int64_t max_steps = rows ? num_steps.max().item<int64_t>() : 0;
  TORCH_CHECK(rows == 0 || num_steps.min().item<int64_t>() >= 1, "greedy_steps: every row takes a step at least");
  const int64_t last = rows ? (positions + num_steps - 1).max().item<int64_t>() : 0;
  TORCH_CHECK(rows == 0 || last / page_size < page_table.size(1), "greedy_steps: a row's last step needs page ",
              last / page_size, " of a table of ", page_table.size(1));
  at::Tensor out = at::full({max_steps, rows}, -1, input_ids.options());
  at::Tensor ids = input_ids, pos = positions, table = page_table.contiguous(), steps = num_steps;
  at::Tensor column = at::arange(rows, input_ids.options());  // each live row's column in `out`
  for (int64_t t = 0; t < max_steps; ++t) {
    if (t > 0) {  // rows whose steps are done leave the batch
      const at::Tensor live = (steps > t).nonzero().squeeze(1);
      if (live.size(0) < ids.size(0)) {
        ids = ids.index_select(0, live);
        pos = pos.index_select(0, live);
        table = table.index_select(0, live);
        steps = steps.index_select(0, live);
        column = column.index_select(0, live);
      }
    }
    const int64_t n = ids.size(0);
    // The batch draft_decode.py builds for these decodes: a slot in the page of each position.
    const at::Tensor slots = table.gather(1, at::floor_divide(pos, page_size).unsqueeze(1)).squeeze(1).to(at::kLong) *
                                 page_size + at::remainder(pos, page_size);
    const at::Tensor query_start_loc = at::arange(n + 1, table.options());
    const at::Tensor context_lens = (pos + 1).to(at::kInt);
    const at::Tensor embedded = at::embedding(embedding, ids);  // layer 0's residual
    at::Tensor hidden = decode_layers(rms_norm(embedded, first_norm, eps), embedded, norms, eps, qkv_w, qkv_bias,
                                      qkv_shape, o_w, o_bias, o_shape, gate_up_w, gate_up_shape, down_w, down_shape,
                                      caches, num_heads, num_kv_heads, head_dim, scale, pos, cos, sin, slots, table,
                                      query_start_loc, context_lens);
    hidden = rms_norm(hidden + embedded, final_norm, eps);
    const at::Tensor logits = head_block_n > 0
                                  ? packed_gemv(hidden, head, head_n, c10::nullopt, head_block_n, head_block_k)
                                  : skinny_linear(hidden, head, c10::nullopt);
    ids = logits.to(at::kFloat).argmax(-1);
    out.index_put_({t, column}, ids);
    pos = pos + 1;
  }
  return out;
}
