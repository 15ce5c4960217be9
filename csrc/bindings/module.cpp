// memoryos-gpu: pybind11 bindings. Validate, release the GIL, call the CPU or CUDA kernel, return.
// Outputs are caller-allocated (NumPy on CPU, torch or CuPy on GPU), so nothing here allocates
// device memory and the module never links against torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <string>

#include "../cpu/threads.h"
#include "assembly_bindings.h"
#include "key_counts_bindings.h"
#include "memoryos/kernels.h"
#include "retrieval_bindings.h"
#include "tensor_arg.h"
#include "text_table.h"

namespace memoryos {
namespace {

EmbDtype emb_dtype(const TensorArg& t, bool on_cuda) {
  if (!on_cuda) {
    expect_dtype(t, {Dt::f32});
    return EmbDtype::kFloat32;
  }
  expect_dtype(t, {Dt::f32, Dt::f16, Dt::bf16});
  return t.dtype == Dt::f16 ? EmbDtype::kFloat16
                            : (t.dtype == Dt::bf16 ? EmbDtype::kBFloat16 : EmbDtype::kFloat32);
}

void require_cuda() {
  if (!cuda_compiled()) {
    throw py::value_error(
        "arrays are on a CUDA device but this build of memoryos_gpu has no CUDA kernels; "
        "rebuild with CUDA (pip install . with nvcc on PATH, or -DMEMOSGPU_CUDA=ON)");
  }
}

QueryBatch query_batch(const TensorArg& emb, const TensorArg& user, const TensorArg* kw) {
  expect_ndim(emb, 2);
  expect(emb, {-1, -1}, Dt::f32);
  expect(user, {emb.dim(0)}, Dt::i32);
  QueryBatch q{};
  q.emb = emb.ptr<float>();
  q.user = user.ptr<int32_t>();
  q.size = emb.dim(0);
  q.dim = static_cast<int32_t>(emb.dim(1));
  if (kw != nullptr) {
    expect(*kw, {emb.dim(0), -1}, Dt::i32);
    q.keywords = kw->ptr<int32_t>();
    q.kw_width = static_cast<int32_t>(kw->dim(1));
  }
  return q;
}

TopK topk_out(const TensorArg& scores, const TensorArg& ids, int64_t batch) {
  expect(scores, {batch, -1}, Dt::f32);
  expect(ids, {batch, scores.dim(1)}, Dt::i32);
  if (scores.dim(1) < 1) throw py::value_error("k must be >= 1, got " + std::to_string(scores.dim(1)));
  return TopK{scores.ptr<float>(), ids.ptr<int32_t>(), static_cast<int32_t>(scores.dim(1))};
}

void score_segments(py::object q_emb, py::object q_user, py::object q_kw, py::object seg_emb,
                    py::object seg_kw, py::object seg_live, float keyword_weight,
                    py::object out_scores, py::object out_ids, int64_t stream) {
  auto qe = tensor_arg(q_emb, "q_emb", stream), qu = tensor_arg(q_user, "q_user", stream),
       qk = tensor_arg(q_kw, "q_kw", stream), se = tensor_arg(seg_emb, "seg_emb", stream),
       sk = tensor_arg(seg_kw, "seg_kw", stream), sl = tensor_arg(seg_live, "seg_live", stream),
       os = tensor_arg(out_scores, "out_scores", stream), oi = tensor_arg(out_ids, "out_ids", stream);
  const bool cuda = same_device({&qe, &qu, &qk, &se, &sk, &sl, &os, &oi});
  QueryBatch q = query_batch(qe, qu, &qk);
  expect_ndim(se, 3);                                   // [U, S, d]
  if (se.dim(2) != q.dim) throw py::value_error("seg_emb dim " + std::to_string(se.dim(2)) +
                                               " != query dim " + std::to_string(q.dim));
  expect(sk, {se.dim(0), se.dim(1), -1}, Dt::i32);      // [U, S, K]
  expect(sl, {se.dim(0), se.dim(1)}, Dt::u8);           // [U, S]
  TopK out = topk_out(os, oi, q.size);
  if (!std::isfinite(keyword_weight)) throw py::value_error("keyword_weight must be finite");
  SegmentView seg{se.data, sk.ptr<int32_t>(), sl.ptr<uint8_t>(), se.dim(0),
                  static_cast<int32_t>(se.dim(1)), static_cast<int32_t>(sk.dim(2)),
                  emb_dtype(se, cuda)};
  if (q.size == 0) return;
  if (cuda) require_cuda();
  py::gil_scoped_release release;
  if (cuda) score_segments_cuda(q, seg, keyword_weight, out, stream);
  else score_segments_cpu(q, seg, keyword_weight, out);
}

void select_pages(py::object q_emb, py::object q_user, py::object chosen, py::object page_emb,
                  py::object page_live, py::object seg_npages, py::object block_table,
                  int32_t block_size, float min_score, py::object out_scores, py::object out_ids,
                  int64_t stream) {
  auto qe = tensor_arg(q_emb, "q_emb", stream), qu = tensor_arg(q_user, "q_user", stream),
       ch = tensor_arg(chosen, "chosen", stream), pe = tensor_arg(page_emb, "page_emb", stream),
       pl = tensor_arg(page_live, "page_live", stream),
       np_ = tensor_arg(seg_npages, "seg_npages", stream),
       bt = tensor_arg(block_table, "block_table", stream),
       os = tensor_arg(out_scores, "out_scores", stream), oi = tensor_arg(out_ids, "out_ids", stream);
  const bool cuda = same_device({&qe, &qu, &ch, &pe, &pl, &np_, &bt, &os, &oi});
  QueryBatch q = query_batch(qe, qu, nullptr);
  expect(ch, {q.size, -1}, Dt::i32);                    // [B, m]
  expect_ndim(pe, 2);                                   // [NP, d]
  if (pe.dim(1) != q.dim) throw py::value_error("page_emb dim " + std::to_string(pe.dim(1)) +
                                               " != query dim " + std::to_string(q.dim));
  expect(pl, {pe.dim(0)}, Dt::u8);                      // [NP]
  expect_ndim(np_, 2);                                  // [U, S]
  expect(np_, {-1, -1}, Dt::i32);
  expect(bt, {np_.dim(0), np_.dim(1), -1}, Dt::i32);    // [U, S, MB]
  if (block_size < 1) throw py::value_error("block_size must be >= 1");
  if (std::isnan(min_score)) throw py::value_error("min_score must not be NaN");
  TopK out = topk_out(os, oi, q.size);
  PageView pages{pe.data, pl.ptr<uint8_t>(), np_.ptr<int32_t>(), bt.ptr<int32_t>(), pe.dim(0),
                 np_.dim(0), static_cast<int32_t>(np_.dim(1)), block_size, static_cast<int32_t>(bt.dim(2)),
                 emb_dtype(pe, cuda)};
  if (q.size == 0) return;
  if (cuda) require_cuda();
  py::gil_scoped_release release;
  if (cuda) select_pages_cuda(q, ch.ptr<int32_t>(), static_cast<int32_t>(ch.dim(1)), pages, min_score, out, stream);
  else select_pages_cpu(q, ch.ptr<int32_t>(), static_cast<int32_t>(ch.dim(1)), pages, min_score, out);
}

HeatState heat_state(const TensorArg& nv, const TensorArg& li, const TensorArg& la,
                     const TensorArg& ht, const TensorArg& live) {
  expect_ndim(live, 2);
  expect(live, {-1, -1}, Dt::u8);                       // [U, S]
  const std::vector<int64_t> us{live.dim(0), live.dim(1)};
  expect(nv, us, Dt::i32);
  expect(li, us, Dt::i32);
  expect(la, us, Dt::f64);
  expect(ht, us, Dt::f32);
  return HeatState{nv.ptr<int32_t>(), li.ptr<int32_t>(), la.ptr<double>(), ht.ptr<float>(),
                   live.ptr<uint8_t>(), live.dim(0), static_cast<int32_t>(live.dim(1))};
}

void apply_hits(py::object hit_user, py::object hit_slot, py::object hit_now, py::object n_visit,
                py::object l_interaction, py::object last_access, py::object heat_, py::object live,
                int64_t stream) {
  auto hu = tensor_arg(hit_user, "hit_user", stream), hs = tensor_arg(hit_slot, "hit_slot", stream),
       hn = tensor_arg(hit_now, "hit_now", stream), nv = tensor_arg(n_visit, "n_visit", stream),
       li = tensor_arg(l_interaction, "l_interaction", stream),
       la = tensor_arg(last_access, "last_access", stream), ht = tensor_arg(heat_, "heat", stream),
       lv = tensor_arg(live, "live", stream);
  const bool cuda = same_device({&hu, &hs, &hn, &nv, &li, &la, &ht, &lv});
  HeatState state = heat_state(nv, li, la, ht, lv);
  expect_ndim(hu, 1);
  expect(hu, {-1}, Dt::i32);
  expect(hs, {hu.dim(0)}, Dt::i32);
  expect(hn, {hu.dim(0)}, Dt::f64);
  HitList hits{hu.ptr<int32_t>(), hs.ptr<int32_t>(), hn.ptr<double>(), hu.dim(0)};
  if (hits.size == 0) return;
  if (cuda) require_cuda();
  py::gil_scoped_release release;
  if (cuda) apply_hits_cuda(hits, state, stream);
  else apply_hits_cpu(hits, state);
}

void recompute_heat(py::object users, py::object now, py::object need_evict, py::object n_visit,
                    py::object l_interaction, py::object last_access, py::object heat_,
                    py::object live, float alpha, float beta, float gamma, double mu, float tau,
                    bool evict_by_visits, py::object out_promote, py::object out_evict,
                    int64_t stream) {
  auto us = tensor_arg(users, "users", stream), nw = tensor_arg(now, "now", stream),
       ne = tensor_arg(need_evict, "need_evict", stream), nv = tensor_arg(n_visit, "n_visit", stream),
       li = tensor_arg(l_interaction, "l_interaction", stream),
       la = tensor_arg(last_access, "last_access", stream), ht = tensor_arg(heat_, "heat", stream),
       lv = tensor_arg(live, "live", stream), op = tensor_arg(out_promote, "out_promote", stream),
       oe = tensor_arg(out_evict, "out_evict", stream);
  const bool cuda = same_device({&us, &nw, &ne, &nv, &li, &la, &ht, &lv, &op, &oe});
  HeatState state = heat_state(nv, li, la, ht, lv);
  expect_ndim(us, 1);
  expect(us, {-1}, Dt::i32);
  expect(nw, {us.dim(0)}, Dt::f64);
  expect(ne, {us.dim(0)}, Dt::u8);
  expect(op, {us.dim(0), state.slots}, Dt::u8);
  expect(oe, {us.dim(0)}, Dt::i32);
  if (!(mu > 0.0) || !std::isfinite(mu)) throw py::value_error("mu must be a positive number of seconds");
  if (!std::isfinite(alpha) || !std::isfinite(beta) || !std::isfinite(gamma) || std::isnan(tau))
    throw py::value_error("heat weights must be finite");
  HeatRecompute req{us.ptr<int32_t>(), nw.ptr<double>(), ne.ptr<uint8_t>(), us.dim(0),
                    evict_by_visits, op.ptr<uint8_t>(), oe.ptr<int32_t>()};
  HeatParams params{alpha, beta, gamma, mu, tau};
  if (req.size == 0) return;
  if (cuda) require_cuda();
  py::gil_scoped_release release;
  if (cuda) recompute_heat_cuda(req, state, params, stream);
  else recompute_heat_cpu(req, state, params);
}

void knowledge_topk(py::object q_emb, py::object q_owner, py::object kn_emb, py::object kn_live,
                    py::object out_scores, py::object out_ids, int64_t stream) {
  auto qe = tensor_arg(q_emb, "q_emb", stream), qo = tensor_arg(q_owner, "q_owner", stream),
       ke = tensor_arg(kn_emb, "kn_emb", stream), kl = tensor_arg(kn_live, "kn_live", stream),
       os = tensor_arg(out_scores, "out_scores", stream), oi = tensor_arg(out_ids, "out_ids", stream);
  const bool cuda = same_device({&qe, &qo, &ke, &kl, &os, &oi});
  QueryBatch q = query_batch(qe, qo, nullptr);
  expect_ndim(ke, 3);                                   // [O, R, d]
  if (ke.dim(2) != q.dim) throw py::value_error("kn_emb dim " + std::to_string(ke.dim(2)) +
                                               " != query dim " + std::to_string(q.dim));
  expect(kl, {ke.dim(0), ke.dim(1)}, Dt::u8);           // [O, R]
  TopK out = topk_out(os, oi, q.size);
  KnowledgeView kn{ke.data, kl.ptr<uint8_t>(), ke.dim(0), static_cast<int32_t>(ke.dim(1)),
                   emb_dtype(ke, cuda)};
  if (q.size == 0) return;
  if (cuda) require_cuda();
  py::gil_scoped_release release;
  if (cuda) knowledge_topk_cuda(q, kn, out, stream);
  else knowledge_topk_cpu(q, kn, out);
}

py::object cpu_cosines_per_isa_py(py::object q, py::object rows, py::object out) {
  auto qa = tensor_arg(q, "q", 0), ra = tensor_arg(rows, "rows", 0), oa = tensor_arg(out, "out", 0);
  if (qa.on_cuda || ra.on_cuda || oa.on_cuda) throw py::value_error("host arrays only");
  expect(qa, {-1}, Dt::f32);
  expect(ra, {-1, qa.dim(0)}, Dt::f32);
  expect(oa, {2, ra.dim(0)}, Dt::f32);
  int builds = 0;
  {
    py::gil_scoped_release release;
    builds = cpu_cosines_per_isa(qa.ptr<float>(), ra.ptr<float>(), ra.dim(0),
                                 static_cast<int>(qa.dim(0)), oa.ptr<float>());
  }
  return py::int_(builds);
}

py::dict build_info() {
  py::dict info;
  info["cpu"] = true;
#if defined(_OPENMP)
  info["openmp"] = true;
  info["cpu_threads"] = cpu::team_size();
#else
  info["openmp"] = false;
  info["cpu_threads"] = 1;
#endif
  info["cpu_team_work"] = cpu::team_work();
  info["cuda_compiled"] = cuda_compiled();
  info["cuda_device_count"] = cuda_compiled() ? cuda_device_count() : 0;
  info["cuda_sync_launches"] = cuda_sync_launches();
#if defined(MEMOSGPU_CUDA_ARCHS)
  info["cuda_archs"] = MEMOSGPU_CUDA_ARCHS;
#else
  info["cuda_archs"] = "";
#endif
  info["version"] = MEMOSGPU_VERSION;
  return info;
}

}  // namespace
}  // namespace memoryos

PYBIND11_MODULE(_C, m) {
  using namespace memoryos;
  namespace py = pybind11;
  m.doc() = "memoryos-gpu native kernels (CPU always; CUDA when compiled). Use memoryos_gpu.ops.";
  m.def("score_segments", &score_segments, py::arg("q_emb"), py::arg("q_user"), py::arg("q_kw"),
        py::arg("seg_emb"), py::arg("seg_kw"), py::arg("seg_live"), py::arg("keyword_weight"),
        py::arg("out_scores"), py::arg("out_ids"), py::arg("stream") = 0,
        "Top-m segments per query by cos + w * Jaccard over the query user's live slots.");
  m.def("select_pages", &select_pages, py::arg("q_emb"), py::arg("q_user"), py::arg("chosen"),
        py::arg("page_emb"), py::arg("page_live"), py::arg("seg_npages"), py::arg("block_table"),
        py::arg("block_size"), py::arg("min_score"), py::arg("out_scores"), py::arg("out_ids"),
        py::arg("stream") = 0, "Top-k pages by cosine inside each query's chosen segments.");
  m.def("apply_hits", &apply_hits, py::arg("hit_user"), py::arg("hit_slot"), py::arg("hit_now"),
        py::arg("n_visit"), py::arg("l_interaction"), py::arg("last_access"), py::arg("heat"),
        py::arg("live"), py::arg("stream") = 0,
        "N_visit += 1 and last_access = max(last_access, now) for each hit segment.");
  m.def("recompute_heat", &recompute_heat, py::arg("users"), py::arg("now"), py::arg("need_evict"),
        py::arg("n_visit"), py::arg("l_interaction"), py::arg("last_access"), py::arg("heat"),
        py::arg("live"), py::arg("alpha"), py::arg("beta"), py::arg("gamma"), py::arg("mu"),
        py::arg("tau"), py::arg("evict_by_visits"), py::arg("out_promote"), py::arg("out_evict"),
        py::arg("stream") = 0,
        "Recompute heat of the users' live segments; flag promotions and pick eviction victims.");
  m.def("knowledge_topk", &knowledge_topk, py::arg("q_emb"), py::arg("q_owner"), py::arg("kn_emb"),
        py::arg("kn_live"), py::arg("out_scores"), py::arg("out_ids"), py::arg("stream") = 0,
        "Top-k knowledge entries by cosine inside each query owner's ring buffer.");
  m.def("build_info", &build_info, "What was compiled and what is usable now.");
  m.def("set_cpu_threads", &cpu::set_team_limit, py::arg("n"),
        "Limit the CPU kernels' OpenMP teams to n threads (n <= 0: OpenMP's default).");
  m.def("set_cpu_team_work", &cpu::set_team_work, py::arg("n"),
        "Multiply-adds a batch needs before a CPU kernel wakes a team (n < 0: the default).");
  m.def("_cpu_cosines_per_isa", &cpu_cosines_per_isa_py, py::arg("q"), py::arg("rows"),
        py::arg("out"),
        "Self-check: cosines by the baseline and (where available) the AVX2 build of the CPU "
        "inner loops into out[0] and out[1]; returns the number of builds that ran.");
  register_retrieval(m);
  register_text_table(m);
  register_assembly(m);
  register_key_counts(m);
}
