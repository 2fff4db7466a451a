// A draft model's greedy proposal in one call: a first step that feeds each row's catch-up
// tokens (the ones the draft has no KV for yet: one after most verifications, the accepted run
// and the target's token otherwise), then steps that each feed the previous step's argmax; per
// step the embedding, the decoder layers (decode_layers.cpp), the final norm, the output
// projection and the argmax, for as many guesses as each row asks. Called by
// engine/spec/fused_draft.py for engine/spec/draft_proposer.py's whole proposal.
//
// Each step is what LlamaForCausalLM.forward + ModelRunner.logits + argmax do for the batch
// engine/spec/draft_decode.py builds: one-token decode entries (a catch-up of c tokens is c
// entries over the same pages, each attending through itself, as a verification's rows are),
// with the same kernels in the same order: embedding, RMSNorm's float32 formula, decode_layers,
// the residual add, RMSNorm again, the packed GEMV (or the skinny kernel for a draft head cut to
// the first token ids), argmax. So the guesses, and the KV written for them, are the Python
// loop's. Why: a draft is small (builtin:code-draft's two layers take well under a millisecond
// of kernels a step) and its guesses are only worth their cost when a step costs far less than a
// target step, so the Python around each step (building the batch, the module calls, the
// argmax's round trip) was most of it.

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

// input_ids [sum(num_fed)] int64: each row's catch-up tokens, row after row; positions [S] int64:
// the position of each row's first one; num_fed [S] int64 >= 1: how many each row feeds in the
// first step (its guess comes after the last); page_table [S, P] int32 (pages already held
// through the last step's position); num_steps [S] int64 >= 1: the steps (guesses) each row
// takes, a row leaving the batch after its last. embedding [V, H]; first_norm: layer 0's input
// norm, final_norm the model's; then the layers as decode_layers takes them (norms .. scale),
// the rotary tables, and the output projection: packed (head_block_n > 0: oneDNN's blocks,
// head_n outputs) or a plain [head_n, H] weight. Returns the guesses [max steps, S] int64, -1
// past a row's last step.
at::Tensor greedy_steps(at::Tensor input_ids, at::Tensor positions, at::Tensor num_fed, at::Tensor page_table,
                        at::Tensor num_steps, int64_t page_size, at::Tensor embedding, at::Tensor first_norm,
                        at::Tensor final_norm, std::vector<at::Tensor> norms, double eps,
                        std::vector<at::Tensor> qkv_w, std::vector<at::Tensor> qkv_bias,
                        std::vector<int64_t> qkv_shape, std::vector<at::Tensor> o_w, std::vector<at::Tensor> o_bias,
                        std::vector<int64_t> o_shape, std::vector<at::Tensor> gate_up_w,
                        std::vector<int64_t> gate_up_shape, std::vector<at::Tensor> down_w,
                        std::vector<int64_t> down_shape, std::vector<at::Tensor> caches, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, double scale, at::Tensor cos, at::Tensor sin,
                        at::Tensor head, int64_t head_n, int64_t head_block_n, int64_t head_block_k) {
  const int64_t rows = positions.size(0);
  TORCH_CHECK(positions.dim() == 1 && num_fed.sizes() == positions.sizes() && num_steps.sizes() == positions.sizes(),
              "greedy_steps: positions, num_fed and num_steps must be [num_seqs]");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == rows && page_table.scalar_type() == at::kInt,
              "greedy_steps: page_table must be [num_seqs, max_pages] int32");
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  num_fed.scalar_type() == at::kLong && num_steps.scalar_type() == at::kLong,
              "greedy_steps: input_ids, positions, num_fed and num_steps must be int64");
  TORCH_CHECK(rows == 0 || (num_steps.min().item<int64_t>() >= 1 && num_fed.min().item<int64_t>() >= 1),
              "greedy_steps: every row feeds a token and takes a step at least");
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.size(0) == (rows ? num_fed.sum().item<int64_t>() : 0),
              "greedy_steps: input_ids must hold every row's num_fed tokens");
  const int64_t max_steps = rows ? num_steps.max().item<int64_t>() : 0;
  // The last position written: a row's catch-up, then one per guess fed back.
  const int64_t last = rows ? (positions + num_fed + num_steps - 2).max().item<int64_t>() : 0;
  TORCH_CHECK(rows == 0 || last / page_size < page_table.size(1), "greedy_steps: a row's last step needs page ",
              last / page_size, " of a table of ", page_table.size(1));
  at::Tensor out = at::full({max_steps, rows}, -1, input_ids.options());
  at::Tensor table = page_table.contiguous(), steps = num_steps;
  at::Tensor column = at::arange(rows, positions.options());  // each live row's column in `out`
  // The first step's entries: each row's catch-up tokens, one entry each at consecutive positions.
  const at::Tensor entry_row = at::repeat_interleave(column, num_fed);
  const at::Tensor ends = at::cumsum(num_fed, 0);  // one past each row's last entry
  at::Tensor ids = input_ids;
  at::Tensor pos = positions.index_select(0, entry_row) + at::arange(ids.size(0), ids.options()) -
                   (ends - num_fed).index_select(0, entry_row);
  at::Tensor entry_table = table.index_select(0, entry_row);
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
      entry_table = table;
    }
    const int64_t n = ids.size(0);
    // The batch draft_decode.py builds for these decodes: a slot in the page of each position.
    const at::Tensor slots =
        entry_table.gather(1, at::floor_divide(pos, page_size).unsqueeze(1)).squeeze(1).to(at::kLong) * page_size +
        at::remainder(pos, page_size);
    const at::Tensor query_start_loc = at::arange(n + 1, table.options());
    const at::Tensor context_lens = (pos + 1).to(at::kInt);
    at::Tensor embedded = at::embedding(embedding, ids);  // layer 0's residual
    at::Tensor hidden = decode_layers(rms_norm(embedded, first_norm, eps), embedded, norms, eps, qkv_w, qkv_bias,
                                      qkv_shape, o_w, o_bias, o_shape, gate_up_w, gate_up_shape, down_w, down_shape,
                                      caches, num_heads, num_kv_heads, head_dim, scale, pos, cos, sin, slots,
                                      entry_table, query_start_loc, context_lens);
    if (t == 0 && n > rows) {  // only each row's last catch-up entry guesses
      const at::Tensor row_last = ends - 1;
      hidden = hidden.index_select(0, row_last);
      embedded = embedded.index_select(0, row_last);
      pos = pos.index_select(0, row_last);
    }
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
