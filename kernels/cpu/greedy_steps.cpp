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
// with the same kernels in the same order: embedding, rms_norm (fused_ops.cpp, as
// RMSNorm.normed takes it), decode_layers, the residual add, rms_norm again, the packed GEMV
// (or the skinny kernel for a draft head cut to the first token ids), argmax. So the guesses,
// and the KV written for them, are the Python loop's. Why: a draft is small (builtin:code-draft's two layers take well under a millisecond
// of kernels a step) and its guesses are only worth their cost when a step costs far less than a
// target step, so the Python around each step (building the batch, the module calls, the
// argmax's round trip) was most of it.

#include <ATen/ATen.h>

#include <cstring>
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
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);

namespace {

// The first index of each row's largest value (torch.argmax's pick among equals), reading
// bf16 or fp32 logits [rows, n] as float: argmax of logits.float(), as the Python path takes it.
std::vector<int64_t> argmax_rows(const at::Tensor& logits) {
  const at::Tensor l = logits.contiguous();
  const int64_t rows = l.size(0), n = l.size(1);
  std::vector<int64_t> best(rows, 0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, l.scalar_type(), "argmax_rows", [&] {
    const scalar_t* p = l.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* row = p + r * n;
      float top = static_cast<float>(row[0]);
      for (int64_t i = 1; i < n; ++i) {
        const float v = static_cast<float>(row[i]);
        if (v > top) {
          top = v;
          best[r] = i;
        }
      }
    }
  });
  return best;
}

// A step's decode entries: each one's row (its column in the guesses), token and position.
struct Entries {
  std::vector<int64_t> row, token, pos;

  void add(int64_t r, int64_t t, int64_t p) {
    row.push_back(r);
    token.push_back(t);
    pos.push_back(p);
  }
  int64_t size() const { return static_cast<int64_t>(row.size()); }
};

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
  // The per-step glue (the batch's slots, lengths and page tables, the embedding lookup, the
  // argmax) is plain loops over these few rows rather than torch ops: a draft guess of
  // builtin:code-draft took ~0.3 ms, of which ~40 dispatched torch ops (2-5 us each) and two
  // torch rms_norms (~20 us each) were a third or more. Integer and copy work only: the tensors
  // handed to the kernels hold what the torch ops computed.
  const at::Tensor table_c = page_table.contiguous();
  const at::Tensor emb = embedding.contiguous();
  const int64_t pages = table_c.size(1), hidden_size = emb.size(1);
  const int32_t* table_p = table_c.data_ptr<int32_t>();
  const at::Tensor ids_c = input_ids.contiguous(), pos_c = positions.contiguous();
  const at::Tensor fed_c = num_fed.contiguous(), steps_c = num_steps.contiguous();
  const int64_t* ids_in = ids_c.data_ptr<int64_t>();
  const int64_t* first_pos = pos_c.data_ptr<int64_t>();
  const int64_t* fed = fed_c.data_ptr<int64_t>();
  const int64_t* steps_of = steps_c.data_ptr<int64_t>();
  const size_t row_bytes = static_cast<size_t>(hidden_size) * emb.element_size();
  const auto* emb_p = static_cast<const char*>(emb.data_ptr());
  int64_t* out_p = out.data_ptr<int64_t>();
  // The first step feeds every row's catch-up tokens, at consecutive positions; each later step
  // the rows still guessing, each its last guess.
  Entries cur;
  for (int64_t r = 0, k = 0; r < rows; ++r)
    for (int64_t j = 0; j < fed[r]; ++j, ++k) cur.add(r, ids_in[k], first_pos[r] + j);
  const auto int64s = input_ids.options();
  const auto int32s = page_table.options();
  for (int64_t t = 0; t < max_steps; ++t) {
    const int64_t n = cur.size();
    at::Tensor pos = at::empty({n}, int64s), slots = at::empty({n}, int64s);
    at::Tensor entry_table = at::empty({n, pages}, int32s), query_start_loc = at::empty({n + 1}, int32s),
               context_lens = at::empty({n}, int32s);
    at::Tensor embedded = at::empty({n, hidden_size}, emb.options());  // layer 0's residual
    int64_t* pos_p = pos.data_ptr<int64_t>();
    int64_t* slot_p = slots.data_ptr<int64_t>();
    int32_t* et_p = entry_table.data_ptr<int32_t>();
    int32_t* qsl_p = query_start_loc.data_ptr<int32_t>();
    int32_t* len_p = context_lens.data_ptr<int32_t>();
    auto* emb_out = static_cast<char*>(embedded.data_ptr());
    qsl_p[0] = 0;
    for (int64_t e = 0; e < n; ++e) {
      const int32_t* row_table = table_p + cur.row[e] * pages;
      const int64_t p = cur.pos[e];
      std::memcpy(et_p + e * pages, row_table, pages * sizeof(int32_t));
      pos_p[e] = p;
      slot_p[e] = static_cast<int64_t>(row_table[p / page_size]) * page_size + p % page_size;
      qsl_p[e + 1] = static_cast<int32_t>(e + 1);
      len_p[e] = static_cast<int32_t>(p + 1);
      const int64_t token = cur.token[e];
      TORCH_CHECK(token >= 0 && token < emb.size(0), "greedy_steps: token ", token, " is outside the embedding's ",
                  emb.size(0), " rows");
      std::memcpy(emb_out + e * row_bytes, emb_p + token * row_bytes, row_bytes);
    }
    at::Tensor hidden = decode_layers(rms_norm(embedded, first_norm, eps), embedded, norms, eps, qkv_w, qkv_bias,
                                      qkv_shape, o_w, o_bias, o_shape, gate_up_w, gate_up_shape, down_w, down_shape,
                                      caches, num_heads, num_kv_heads, head_dim, scale, pos, cos, sin, slots,
                                      entry_table, query_start_loc, context_lens);
    if (t == 0 && n > rows) {  // only each row's last catch-up entry guesses
      std::vector<int64_t> row_last;
      Entries kept;
      for (int64_t e = 0; e < n; ++e)
        if (e + 1 == n || cur.row[e + 1] != cur.row[e]) {
          row_last.push_back(e);
          kept.add(cur.row[e], cur.token[e], cur.pos[e]);
        }
      const at::Tensor keep = at::tensor(row_last, int64s);
      hidden = hidden.index_select(0, keep);
      embedded = embedded.index_select(0, keep);
      cur = std::move(kept);
    }
    const at::Tensor normed = rms_norm(hidden + embedded, final_norm, eps);
    const at::Tensor logits = head_block_n > 0
                                  ? packed_gemv(normed, head, head_n, c10::nullopt, head_block_n, head_block_k)
                                  : skinny_linear(normed, head, c10::nullopt);
    const std::vector<int64_t> guess = argmax_rows(logits);
    // Rows whose steps are done leave the batch; the rest feed their guess at the next position.
    Entries next;
    for (int64_t e = 0; e < cur.size(); ++e) {
      out_p[t * rows + cur.row[e]] = guess[e];
      if (steps_of[cur.row[e]] > t + 1) next.add(cur.row[e], guess[e], cur.pos[e] + 1);
    }
    cur = std::move(next);
  }
  return out;
}
