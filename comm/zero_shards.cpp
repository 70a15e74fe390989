#include "comm/zero_shards.h"

#include <algorithm>
#include <set>
#include <stdexcept>
#include <utility>

#include "runtime/core/device_memory.h"
#include "runtime/ops/ops.h"

namespace amp::comm {

ZeroShards::ZeroShards(BucketLayout layout, const std::vector<Tensor>& params,
                       const std::vector<std::vector<Tensor>>& groups, Communicator& comm)
    : comm_(comm), layout_(std::move(layout)), params_(params), full_id_(params.size(), -1), group_of_(params.size()) {
  if (layout_.numel.empty() || layout_.slots.size() != params.size())
    throw std::invalid_argument("ZeroShards: the layout is not the parameters'");
  std::vector<size_t>& group_of = group_of_;
  std::vector<size_t> index_in_group(params.size());
  int64_t id = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].empty())  // (its 0-element piece is a view of its first parameter)
      throw std::invalid_argument("ZeroShards: parameter group " + std::to_string(g) + " is empty");
    for (size_t j = 0; j < groups[g].size(); ++j) {
      size_t i = 0;
      while (i < params.size() && !params[i].same(groups[g][j])) ++i;
      if (i == params.size() || full_id_[i] >= 0)
        throw std::invalid_argument("ZeroShards: every parameter must be in exactly one group");
      full_id_[i] = id++;
      group_of[i] = g;
      index_in_group[i] = j;
    }
  }
  if (static_cast<size_t>(id) != params.size())
    throw std::invalid_argument("ZeroShards: every parameter must be in exactly one group");
  const int64_t R = comm.size(), me = comm.rank();
  std::vector<const SlotLayout*> slot_of(params.size(), nullptr);
  for (const SlotLayout& s : layout_.slots) {
    slot_of.at(s.param) = &s;
    const int64_t shard = layout_.numel[s.bucket] / R;
    const int64_t lo = std::max(s.offset, me * shard), hi = std::min(s.offset + s.numel, (me + 1) * shard);
    if (hi > lo)
      pieces_.push_back({s.param, group_of[s.param], lo - s.offset, s.bucket, lo, hi - lo, Tensor()});
  }
  // Every group on every rank, so that the optimizers agree on the groups and their step counts.
  for (size_t g = 0; g < groups.size(); ++g) {
    if (std::any_of(pieces_.begin(), pieces_.end(), [&](const Piece& p) { return p.group == g; })) continue;
    size_t first = 0;
    while (!params[first].same(groups[g][0])) ++first;
    pieces_.push_back({first, g, 0, slot_of[first]->bucket, slot_of[first]->offset, 0, Tensor()});
  }
  std::sort(pieces_.begin(), pieces_.end(), [&](const Piece& a, const Piece& b) {
    return std::make_pair(a.group, index_in_group[a.param]) < std::make_pair(b.group, index_in_group[b.param]);
  });
  piece_groups_.resize(groups.size());
  for (Piece& p : pieces_) {
    p.view = params[p.param].view(0, {params[p.param].numel()}).view(p.param_offset, {p.numel});
    p.view.set_requires_grad(true);
    piece_groups_[p.group].push_back(p.view);
  }
}

void ZeroShards::attach(std::vector<Tensor> buffers) {
  if (buffers.size() != layout_.numel.size()) throw std::invalid_argument("ZeroShards::attach: not the layout's buckets");
  for (size_t b = 0; b < buffers.size(); ++b)
    if (buffers[b].numel() != layout_.numel[b]) throw std::invalid_argument("ZeroShards::attach: not the layout's buckets");
  buffers_ = std::move(buffers);
}

void ZeroShards::assign_grads() {
  for (Piece& p : pieces_) p.view.set_grad(buffers_.at(p.bucket).view(p.bucket_offset, {p.numel}));
}

void ZeroShards::gather_parameters() {
  DeviceMemory& mem = memory_for(params_[0].device());
  for (const Piece& p : pieces_) {
    if (p.numel == 0) continue;
    float* dst = static_cast<float*>(buffers_.at(p.bucket).data_ptr()) + p.bucket_offset;
    mem.copy(dst, p.view.data_ptr(), static_cast<size_t>(p.numel) * sizeof(float));
  }
  std::vector<std::unique_ptr<Work>> works;
  for (Tensor& b : buffers_) works.push_back(comm_.all_gather_shards_async(b));
  for (auto& w : works) w->wait();
  for (const SlotLayout& s : layout_.slots) {
    const float* src = static_cast<const float*>(buffers_.at(s.bucket).data_ptr()) + s.offset;
    mem.copy(params_[s.param].data_ptr(), src, static_cast<size_t>(s.numel) * sizeof(float));
  }
}

std::vector<nn::NamedTensor> ZeroShards::named_pieces(const std::vector<nn::NamedTensor>& named_params) const {
  std::vector<nn::NamedTensor> out;
  for (const Piece& p : pieces_) {
    if (p.numel == 0) continue;
    for (const auto& [name, t] : named_params)
      if (t.same(params_[p.param])) out.emplace_back(name, p.view);
  }
  return out;
}

int64_t ZeroShards::piece_elements() const {
  int64_t n = 0;
  for (const Piece& p : pieces_) n += p.numel;
  return n;
}

int64_t ZeroShards::total_elements() const {
  int64_t n = 0;
  for (const Tensor& p : params_) n += p.numel();
  return n;
}

optim::OptimizerStateDict ZeroShards::full_state_dict(const optim::Optimizer& opt, bool keep) {
  const optim::OptimizerStateDict local = opt.state_dict();  // keyed by piece: opt's parameters are pieces_
  optim::OptimizerStateDict full;
  // The unsharded optimizer's groups: the same hyperparameters, its parameters' ids.
  full.param_groups = local.param_groups;
  for (size_t g = 0; g < piece_groups_.size(); ++g) full.param_groups.at(g)["params"] = nlohmann::json::array();
  std::vector<std::pair<int64_t, size_t>> by_id;
  for (size_t i = 0; i < params_.size(); ++i) by_id.emplace_back(full_id_[i], i);
  std::sort(by_id.begin(), by_id.end());
  const std::vector<size_t>& group_of = group_of_;
  for (const auto& [id, i] : by_id) full.param_groups.at(group_of[i])["params"].push_back(id);
  // Each group's state as one piece of it has it (every piece of a group steps together): none
  // before the first step, as PyTorch's.
  std::vector<const std::map<std::string, Tensor>*> rep(piece_groups_.size(), nullptr);
  std::set<std::string> names;
  for (size_t k = 0; k < pieces_.size(); ++k) {
    auto it = local.state.find(static_cast<int64_t>(k));
    if (it == local.state.end()) continue;
    if (!rep[pieces_[k].group]) rep[pieces_[k].group] = &it->second;
    for (const auto& [name, t] : it->second)
      if (name != "step") names.insert(name);
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (const auto* r = rep[group_of[i]]; keep && r && r->count("step")) full.state[full_id_[i]]["step"] = r->at("step").clone();
  // Each per-element state, bucket by bucket: every rank's pieces in place, the shards gathered.
  const Device device = params_[0].device();
  DeviceMemory& mem = memory_for(device);
  for (const std::string& name : names) {  // the same names, in the same order, on every rank
    for (size_t b = 0; b < layout_.numel.size(); ++b) {
      Tensor staged = zeros({layout_.numel[b]}, DType::f32, device);
      for (size_t k = 0; k < pieces_.size(); ++k) {
        const Piece& p = pieces_[k];
        auto it = local.state.find(static_cast<int64_t>(k));
        if (p.bucket != b || p.numel == 0 || it == local.state.end() || !it->second.count(name)) continue;
        mem.copy(static_cast<float*>(staged.data_ptr()) + p.bucket_offset, it->second.at(name).data_ptr(),
                 static_cast<size_t>(p.numel) * sizeof(float));
      }
      comm_.all_gather_shards_async(staged)->wait();
      if (!keep) continue;
      // Kept in host memory, a bucket at a time: the whole state on one GPU could be what ZeRO-1 was
      // there to avoid.
      const Tensor host = staged.to(kCPU);
      for (const SlotLayout& s : layout_.slots) {
        const auto* r = rep[group_of[s.param]];
        if (s.bucket != b || !r || !r->count(name)) continue;
        full.state[full_id_[s.param]][name] = host.view(s.offset, params_[s.param].shape()).clone();
      }
    }
  }
  return full;
}

optim::OptimizerStateDict ZeroShards::shard_state_dict(const optim::OptimizerStateDict& full,
                                                       const optim::Optimizer& opt) const {
  // The saved ids map to the parameters as an unsharded load_state_dict maps them (group by group, in
  // order), and the saved groups' hyperparameters are kept: the same state dict loads the same way
  // with and without ZeRO-1, and what it refuses is refused alike.
  const size_t G = piece_groups_.size();
  if (!full.param_groups.is_array() || full.param_groups.size() != G)
    throw std::invalid_argument("loaded state dict has a different number of parameter groups");
  std::vector<std::vector<size_t>> members(G);  // each group's parameters in order (full_id_'s order)
  std::vector<size_t> by_id(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) by_id[static_cast<size_t>(full_id_[i])] = i;
  for (size_t i : by_id) members[group_of_[i]].push_back(i);
  std::vector<int64_t> saved_id(params_.size(), -1);
  std::set<int64_t> known;
  for (size_t g = 0; g < G; ++g) {
    const nlohmann::json& h = full.param_groups[g];
    if (!h.is_object() || !h.contains("params") || !h["params"].is_array())
      throw std::invalid_argument("loaded state dict: parameter group " + std::to_string(g) + " has no 'params' list");
    if (h["params"].size() != members[g].size())
      throw std::invalid_argument("loaded state dict contains a parameter group that doesn't match the size of optimizer's group");
    for (size_t j = 0; j < members[g].size(); ++j) {
      if (!h["params"][j].is_number_integer()) throw std::invalid_argument("loaded state dict: a parameter id is not an integer");
      saved_id[members[g][j]] = h["params"][j].get<int64_t>();
      if (!known.insert(saved_id[members[g][j]]).second)
        throw std::invalid_argument("loaded state dict: parameter id " + std::to_string(saved_id[members[g][j]]) + " is listed twice");
    }
  }
  for (const auto& [id, st] : full.state)
    if (!known.count(id)) throw std::invalid_argument("loaded state dict has state for unknown parameter " + std::to_string(id));
  optim::OptimizerStateDict sd;
  sd.param_groups = full.param_groups;
  const nlohmann::json mine = opt.state_dict().param_groups;
  for (size_t g = 0; g < G; ++g) sd.param_groups[g]["params"] = mine.at(g).at("params");
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    auto it = full.state.find(saved_id[p.param]);
    if (it == full.state.end()) continue;
    std::map<std::string, Tensor>& st = sd.state[static_cast<int64_t>(k)];
    for (const auto& [name, t] : it->second) {
      if (name == "step") st[name] = t;
      else if (t.numel() != params_[p.param].numel())
        throw std::invalid_argument("optimizer state '" + name + "' of parameter " + std::to_string(it->first) +
                                    " has " + std::to_string(t.numel()) + " elements, expected " +
                                    std::to_string(params_[p.param].numel()));
      else st[name] = t.view(0, {t.numel()}).view(p.param_offset, {p.numel}).clone();
    }
  }
  return sd;
}

}  // namespace amp::comm
