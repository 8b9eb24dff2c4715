// The compiled suffix tree: the same trie, counts, drafts and tie-breaks as the Python
// reference in suffix_tree.py (SuffixDecoding, arXiv 2411.04975), node for node.
// tests/unit/test_suffix_tree_compiled.py checks the two agree on random traces (hypothesis).
//
// Layout: nodes live in one vector and refer to each other by index (a tree only grows, so an
// index stays valid for the tree's life). A node seen once is a lazy leaf (kids == -1): its
// continuation is read from the sequence it references. Children are kept in insertion order
// (the reference's dict order decides ties), with a hash index once a node has more than 8.
// Each tree has a reader/writer lock: a call that changes it holds it alone, readers share it.
// `step_batch` (one router step for many sessions) runs without the GIL, so another thread's
// reads and writes (a feed inserting peers' outputs) are kept apart by that lock, not the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <queue>
#include <shared_mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using Tok = int64_t;

struct Node {
    int64_t count;
    int64_t stamp;    // the tree's clock at this node's last count increment (0: never)
    Tok token;
    int32_t depth;
    int32_t seq;      // one occurrence: this node's string is seqs[seq][end-depth:end]
    int32_t end;
    int32_t best;     // most frequent child, the most recently counted on ties; -1: none
    int32_t kids;     // index into kids_, -1: a lazy leaf
};

struct Kids {
    std::vector<std::pair<Tok, int32_t>> list;  // insertion order
    std::unordered_map<Tok, int32_t> index;     // filled once list outgrows kLinear

    static constexpr size_t kLinear = 8;

    int32_t find(Tok t) const {
        if (!index.empty()) {
            auto it = index.find(t);
            return it == index.end() ? -1 : it->second;
        }
        for (const auto& [tok, id] : list)
            if (tok == t) return id;
        return -1;
    }

    void add(Tok t, int32_t id) {
        list.emplace_back(t, id);
        if (!index.empty()) {
            index.emplace(t, id);
        } else if (list.size() > kLinear) {
            for (const auto& [tok, i] : list) index.emplace(tok, i);
        }
    }
};

struct Match {
    int32_t node;
    int32_t extra;  // implicit tokens read past a lazy leaf
};

struct Matches {
    std::vector<Match> items;  // longest first
    std::vector<Tok> tail;     // the context's last max_depth tokens
};

// (token_ids, probs, parents, score, match_len), as the reference returns it.
using Draft = std::tuple<std::vector<Tok>, std::vector<double>, std::vector<int32_t>, double, int32_t>;

struct Candidate {
    std::vector<Tok> ids;
    std::vector<double> probs;
    std::vector<int32_t> parents;
    double score = 0.0;
    int32_t match_len = 0;

    void finish() {
        score = 0.0;
        for (double p : probs) score += p;  // left to right, as Python's sum
    }
    Draft out() && { return {std::move(ids), std::move(probs), std::move(parents), score, match_len}; }
};

struct Limits {
    int max_spec_tokens;
    double max_spec_factor, max_spec_offset, min_token_prob;
};

// Append-only storage in chunks of at most kSize elements: growing copies at most one chunk, so
// a tree of millions of nodes grows without the whole-array copy a vector's doubling makes
// (20-70 ms at 0.5-1 M nodes, and the shared tree grows on the router's step path). As with a
// vector, a reference into the last chunk may move when an element is added.
template <typename T>
class Chunked {
public:
    static constexpr size_t kBits = 14, kSize = size_t{1} << kBits, kMask = kSize - 1;

    T& operator[](size_t i) { return chunks_[i >> kBits][i & kMask]; }
    const T& operator[](size_t i) const { return chunks_[i >> kBits][i & kMask]; }
    size_t size() const { return size_; }

    template <typename... Args>
    void emplace_back(Args&&... args) {
        if (chunks_.empty() || chunks_.back().size() == kSize) chunks_.emplace_back();
        chunks_.back().emplace_back(std::forward<Args>(args)...);
        ++size_;
    }

private:
    std::vector<std::vector<T>> chunks_;
    size_t size_ = 0;
};

class SuffixTree {
public:
    explicit SuffixTree(int max_depth) : max_depth_(max_depth) {
        nodes_.emplace_back(Node{0, 0, -1, 0, -1, 0, -1, 0});
        kids_.emplace_back();
    }

    int new_seq() {
        std::unique_lock lock(mu_);
        return new_seq_();
    }

    void extend(int s, const std::vector<Tok>& tokens) {
        std::unique_lock lock(mu_);
        extend_(s, tokens);
    }

    int add(const std::vector<Tok>& tokens) {
        std::unique_lock lock(mu_);
        int s = new_seq_();
        extend_(s, tokens);
        std::vector<int32_t>().swap(actives_[s]);  // a finished sequence is never extended
        return s;
    }

    Matches match(const std::vector<Tok>& context) const {
        std::shared_lock lock(mu_);
        return match_(context);
    }

    void advance(Matches& m, const std::vector<Tok>& tokens) const {
        std::shared_lock lock(mu_);
        advance_(m, tokens);
    }

    Draft speculate(int s, int budget, int max_spec_tokens, double factor, double offset, double min_prob,
                    bool tree) const {
        std::shared_lock lock(mu_);
        return speculate_(s, budget, Limits{max_spec_tokens, factor, offset, min_prob}, tree);
    }

    Draft speculate_matches(const Matches& m, int budget, int max_spec_tokens, double factor, double offset,
                            double min_prob, bool tree) const {
        std::shared_lock lock(mu_);
        return best_draft(m.items, budget, Limits{max_spec_tokens, factor, offset, min_prob}, tree);
    }

    // One router step's suffix drafting for many sessions (services/drafter/suffix.py:
    // SuffixDrafter._step_cache), in the order the per-session calls would make it: first each
    // session's new tokens enter its own tree and (`grow`) its live output in `global`, and its
    // global matches advance (mode kAdvance), session by session; then each asked session
    // (budget > 0) re-matches its context where its matches went stale (kRematch) and drafts
    // from both trees, the global draft winning only on a higher score. Returns the drafts (and
    // whether global won) and each live output's sequence in `global`. Runs without the GIL.
    // With `lag`, `global` is not written: a session drafts from a copy of its matches advanced
    // over the tree as it is, and `grow_live` (once the step is sent) grows the live outputs and
    // advances the matches themselves; the drafts then miss only the step's own new tokens in
    // the shared tree.
    using Batch = std::tuple<std::vector<std::tuple<Draft, bool>>, std::vector<int>>;
    static Batch step_batch(SuffixTree& global, const std::vector<SuffixTree*>& locals, const std::vector<int>& seqs,
                            const std::vector<std::vector<Tok>>& tokens, std::vector<int> live_seqs,
                            const std::vector<std::vector<Tok>>& carries, const std::vector<Matches*>& matches,
                            const std::vector<int>& modes, const std::vector<std::vector<Tok>>& contexts,
                            const std::vector<int>& budgets, int max_spec_tokens, double factor, double offset,
                            double min_prob, bool tree, bool lag) {
        const size_t n = locals.size();
        if (seqs.size() != n || tokens.size() != n || live_seqs.size() != n || carries.size() != n ||
            matches.size() != n || modes.size() != n || contexts.size() != n || budgets.size() != n)
            throw py::value_error("step_batch: one entry per session in every list");
        const Limits lim{max_spec_tokens, factor, offset, min_prob};
        for (size_t i = 0; i < n; ++i) locals[i]->extend(seqs[i], tokens[i]);
        if (!lag) {
            std::unique_lock glock(global.mu_);
            global.grow_(live_seqs, carries, tokens, matches, modes);
        }
        std::vector<std::tuple<Draft, bool>> out(n);
        std::shared_lock glock(global.mu_);
        for (size_t i = 0; i < n; ++i) {
            if (budgets[i] <= 0) continue;
            if (modes[i] == kRematch) *matches[i] = global.match_(contexts[i]);
            Draft local;
            {
                std::shared_lock llock(locals[i]->mu_);
                local = locals[i]->speculate_(seqs[i], budgets[i], lim, tree);
            }
            Matches ahead;
            const Matches* m = matches[i];
            if (lag && modes[i] == kAdvance) {
                ahead = *m;
                global.advance_(ahead, tokens[i]);
                m = &ahead;
            }
            if (!m->items.empty()) {
                Draft glob = global.best_draft(m->items, budgets[i], lim, tree);
                if (std::get<3>(glob) > std::get<3>(local)) {
                    out[i] = {std::move(glob), true};
                    continue;
                }
            }
            out[i] = {std::move(local), false};
        }
        return {std::move(out), std::move(live_seqs)};
    }

    // A lagged step's shared-tree writes (step_batch with `lag`), as its first phase would have
    // made them: each live output takes its new tokens (a live output the tree lacks, live_seqs
    // kCarry, enters first as a new sequence of `carries`) and its session's matches advance
    // (kAdvance), session by session; then the kRematch sessions re-match their `contexts`.
    // Returns each live output's sequence. Runs without the GIL.
    static std::vector<int> grow_live(SuffixTree& global, std::vector<int> live_seqs,
                                      const std::vector<std::vector<Tok>>& carries,
                                      const std::vector<std::vector<Tok>>& tokens,
                                      const std::vector<Matches*>& matches, const std::vector<int>& modes,
                                      const std::vector<std::vector<Tok>>& contexts) {
        const size_t n = live_seqs.size();
        if (carries.size() != n || tokens.size() != n || matches.size() != n || modes.size() != n ||
            contexts.size() != n)
            throw py::value_error("grow_live: one entry per session in every list");
        std::unique_lock glock(global.mu_);
        global.grow_(live_seqs, carries, tokens, matches, modes, &contexts);
        return live_seqs;
    }

    static constexpr int kAdvance = 1, kRematch = 2;  // step_batch's modes (0: leave the matches)
    static constexpr int kCarry = -1;                 // step_batch's live_seqs: not in the tree yet (-2: none)

    std::vector<int32_t> match_lengths(const Matches& m) const {
        std::shared_lock lock(mu_);
        std::vector<int32_t> out;
        for (const Match& x : m.items) out.push_back(nodes_[x.node].depth + x.extra);
        return out;
    }

    int64_t count(const std::vector<Tok>& tokens) const {
        std::shared_lock lock(mu_);
        int32_t n = 0, x = 0;
        for (Tok t : tokens) {
            const Node& nd = nodes_[n];
            if (nd.depth + x >= max_depth_) return 0;
            if (nd.kids < 0) {
                const auto& sq = seqs_[nd.seq];
                size_t i = static_cast<size_t>(nd.end) + x;
                if (i >= sq.size() || sq[i] != t) return 0;
                ++x;
            } else {
                n = kids_[nd.kids].find(t);
                if (n < 0) return 0;
            }
        }
        return nodes_[n].count;
    }

    int64_t total() const {
        std::shared_lock lock(mu_);
        return nodes_[0].count;
    }
    int64_t num_nodes() const {
        std::shared_lock lock(mu_);
        return static_cast<int64_t>(nodes_.size()) - 1;
    }
    int max_depth() const { return max_depth_; }

private:
    int max_depth_;
    mutable std::shared_mutex mu_;
    Chunked<Node> nodes_;
    Chunked<Kids> kids_;
    std::vector<std::vector<Tok>> seqs_;
    std::vector<std::vector<int32_t>> actives_;  // each sequence's repeated suffixes, longest first
    std::vector<int32_t> next_;
    int64_t clock_ = 0;  // count increments so far: recency breaks ties between equal counts

    void check_seq(int s) const {
        if (s < 0 || static_cast<size_t>(s) >= seqs_.size()) throw py::index_error("no such sequence in this tree");
    }

    // The calls above without their lock (the caller holds it).
    int new_seq_() {
        seqs_.emplace_back();
        actives_.emplace_back();
        return static_cast<int>(seqs_.size()) - 1;
    }

    void extend_(int s, const std::vector<Tok>& tokens) {
        check_seq(s);
        for (Tok t : tokens) append(s, t);
    }

    // The live outputs' new tokens and the matches' advance (step_batch's first phase in the
    // shared tree), session by session; live_seqs are updated where a carried output entered as
    // a new sequence. With `contexts`, the kRematch sessions then re-match theirs (as step_batch
    // would after this phase).
    void grow_(std::vector<int>& live_seqs, const std::vector<std::vector<Tok>>& carries,
               const std::vector<std::vector<Tok>>& tokens, const std::vector<Matches*>& matches,
               const std::vector<int>& modes, const std::vector<std::vector<Tok>>* contexts = nullptr) {
        for (size_t i = 0; i < live_seqs.size(); ++i) {
            if (live_seqs[i] == kCarry) {
                live_seqs[i] = new_seq_();
                extend_(live_seqs[i], carries[i]);
            }
            if (live_seqs[i] >= 0) extend_(live_seqs[i], tokens[i]);
            if (modes[i] == kAdvance) advance_(*matches[i], tokens[i]);
        }
        if (contexts == nullptr) return;
        for (size_t i = 0; i < live_seqs.size(); ++i)
            if (modes[i] == kRematch) *matches[i] = match_((*contexts)[i]);
    }

    Matches match_(const std::vector<Tok>& context) const {
        Matches m;
        size_t from = context.size() > static_cast<size_t>(max_depth_) ? context.size() - max_depth_ : 0;
        advance_(m, std::vector<Tok>(context.begin() + from, context.end()));
        return m;
    }

    void advance_(Matches& m, const std::vector<Tok>& tokens) const {
        for (Tok t : tokens) {
            advance_one(m.items, t, m.tail);
            m.tail.push_back(t);
            if (m.tail.size() > static_cast<size_t>(max_depth_)) m.tail.erase(m.tail.begin());
        }
    }

    Draft speculate_(int s, int budget, const Limits& lim, bool tree) const {
        check_seq(s);
        std::vector<Match> ms;
        ms.reserve(actives_[s].size());
        for (int32_t n : actives_[s]) ms.push_back(Match{n, 0});
        return best_draft(ms, budget, lim, tree);
    }

    int32_t new_node(Tok token, int32_t depth, int32_t seq, int32_t end) {
        nodes_.emplace_back(Node{1, 0, token, depth, seq, end, -1, -1});
        return static_cast<int32_t>(nodes_.size()) - 1;
    }

    // Rule: appending a token bumps the child of every repeated suffix and of the root; a new
    // child is a lazy leaf; a leaf seen a second time gets an explicit child for its first
    // occurrence's next token; the repeated children are the new repeated suffixes.
    void append(int s, Tok token) {
        seqs_[s].push_back(token);
        const int32_t end = static_cast<int32_t>(seqs_[s].size());
        nodes_[0].count += 1;
        std::vector<int32_t>& act = actives_[s];
        next_.clear();
        for (size_t i = 0; i <= act.size(); ++i) {
            const int32_t n = i < act.size() ? act[i] : 0;
            if (nodes_[n].depth >= max_depth_) continue;
            int32_t c = kids_[nodes_[n].kids].find(token);
            if (c < 0) {
                c = new_node(token, nodes_[n].depth + 1, s, end);
                kids_[nodes_[n].kids].add(token, c);
                if (nodes_[n].best < 0) nodes_[n].best = c;
                continue;
            }
            if (nodes_[c].count == 1) materialize(c);
            Node& ch = nodes_[c];
            ch.count += 1;
            ch.stamp = ++clock_;
            ch.seq = s;
            ch.end = end;
            if (ch.count >= nodes_[nodes_[n].best].count) nodes_[n].best = c;
            next_.push_back(c);
        }
        act.swap(next_);
    }

    void materialize(int32_t c) {
        const int32_t k = static_cast<int32_t>(kids_.size());
        kids_.emplace_back();
        nodes_[c].kids = k;
        const Node nd = nodes_[c];
        const auto& sq = seqs_[nd.seq];
        if (static_cast<size_t>(nd.end) < sq.size() && nd.depth < max_depth_) {
            const Tok t = sq[nd.end];
            const int32_t g = new_node(t, nd.depth + 1, nd.seq, nd.end + 1);
            kids_[k].add(t, g);
            nodes_[c].best = g;
        }
    }

    // Matches of the context extended by `token`, longest first, the root's own last. A match
    // that ran past a lazy leaf since materialized (the tree grew) first walks down the
    // explicit children its implicit tokens (the tail's last `extra`) now name.
    void advance_one(std::vector<Match>& ms, Tok token, const std::vector<Tok>& tail) const {
        std::vector<Match> out;
        out.reserve(ms.size() + 1);
        for (size_t i = 0; i <= ms.size(); ++i) {
            Match m = i < ms.size() ? ms[i] : Match{0, 0};
            while (m.extra > 0 && m.node >= 0 && nodes_[m.node].kids >= 0) {
                m.node = kids_[nodes_[m.node].kids].find(tail[tail.size() - m.extra]);
                m.extra -= 1;
            }
            if (m.node < 0) continue;  // cannot happen: a materialized leaf keeps its path
            const Node& nd = nodes_[m.node];
            if (nd.depth + m.extra >= max_depth_) continue;
            if (nd.kids < 0) {
                const auto& sq = seqs_[nd.seq];
                size_t j = static_cast<size_t>(nd.end) + m.extra;
                if (j < sq.size() && sq[j] == token) out.push_back(Match{m.node, m.extra + 1});
            } else {
                int32_t c = kids_[nd.kids].find(token);
                if (c >= 0) out.push_back(Match{c, 0});
            }
        }
        ms.swap(out);
    }

    Draft best_draft(const std::vector<Match>& ms, int budget, const Limits& p, bool tree) const {
        Candidate best;
        for (const Match& m : ms) {
            const int32_t match_len = nodes_[m.node].depth + m.extra;
            const int limit = std::min({budget, p.max_spec_tokens,
                                        static_cast<int>(match_len * p.max_spec_factor + p.max_spec_offset + 1e-6)});
            if (limit <= best.score) continue;  // every token adds ≤ 1 to the score: cannot win
            Candidate c = tree ? grow_tree(m, limit, p.min_token_prob) : grow_path(m, limit, p.min_token_prob);
            if (c.score > best.score) {
                c.match_len = match_len;
                best = std::move(c);
            }
        }
        return std::move(best).out();
    }

    // Follow the most frequent child while the running probability stays ≥ min_prob; past a
    // lazy leaf copy its one continuation at an unchanged probability.
    Candidate grow_path(Match m, int limit, double min_prob) const {
        Candidate c;
        double prob = 1.0;
        int32_t n = m.node, x = m.extra;
        while (static_cast<int>(c.ids.size()) < limit) {
            const Node& nd = nodes_[n];
            if (nd.kids < 0) {
                const auto& sq = seqs_[nd.seq];
                const int64_t i = static_cast<int64_t>(nd.end) + x;
                const int64_t room = std::min({static_cast<int64_t>(limit) - static_cast<int64_t>(c.ids.size()),
                                               static_cast<int64_t>(sq.size()) - i,
                                               static_cast<int64_t>(max_depth_ - nd.depth - x)});
                if (room <= 0) break;
                c.ids.insert(c.ids.end(), sq.begin() + i, sq.begin() + i + room);
                c.probs.insert(c.probs.end(), room, prob);
                break;
            }
            if (nd.best < 0) break;
            const Node& ch = nodes_[nd.best];
            prob *= static_cast<double>(ch.count) / static_cast<double>(nd.count);
            if (prob < min_prob) break;
            c.ids.push_back(ch.token);
            c.probs.push_back(prob);
            n = nd.best;
            x = 0;
        }
        c.finish();
        return c;
    }

    struct Entry {
        double q;
        int64_t order;  // ties pop in push order
        int32_t parent;
        Tok token;
        int32_t node, extra;
    };
    struct Lower {
        bool operator()(const Entry& a, const Entry& b) const {
            return a.q < b.q || (a.q == b.q && a.order > b.order);
        }
    };
    using Heap = std::priority_queue<Entry, std::vector<Entry>, Lower>;

    // SuffixDecoding's speculation tree: grow best-first by running probability.
    Candidate grow_tree(Match m, int limit, double min_prob) const {
        Candidate c;
        Heap heap;
        int64_t order = 0;
        push_next(heap, order, -1, m.node, m.extra, 1.0, min_prob);
        while (!heap.empty() && static_cast<int>(c.ids.size()) < limit) {
            const Entry e = heap.top();
            heap.pop();
            c.ids.push_back(e.token);
            c.probs.push_back(e.q);
            c.parents.push_back(e.parent);
            push_next(heap, order, static_cast<int32_t>(c.ids.size()) - 1, e.node, e.extra, e.q, min_prob);
        }
        c.finish();
        return c;
    }

    // The continuations of a match worth drafting, most frequent first (ties: most recently
    // counted first, then insertion order), each at its running probability.
    void push_next(Heap& heap, int64_t& order, int32_t parent, int32_t n, int32_t x, double prob,
                   double min_prob) const {
        const Node& nd = nodes_[n];
        if (nd.kids < 0) {
            const auto& sq = seqs_[nd.seq];
            const size_t i = static_cast<size_t>(nd.end) + x;
            if (i < sq.size() && nd.depth + x < max_depth_) heap.push(Entry{prob, order++, parent, sq[i], n, x + 1});
            return;
        }
        if (nd.best < 0 || prob * static_cast<double>(nodes_[nd.best].count) < min_prob * static_cast<double>(nd.count))
            return;
        const double need = min_prob * static_cast<double>(nd.count) / prob;
        std::vector<int32_t> kids;
        for (const auto& kv : kids_[nd.kids].list)
            if (static_cast<double>(nodes_[kv.second].count) >= need) kids.push_back(kv.second);
        std::stable_sort(kids.begin(), kids.end(),
                         [this](int32_t a, int32_t b) {
                             const Node &x = nodes_[a], &y = nodes_[b];
                             return x.count > y.count || (x.count == y.count && x.stamp > y.stamp);
                         });
        for (int32_t k : kids) {
            const double q = prob * static_cast<double>(nodes_[k].count) / static_cast<double>(nd.count);
            heap.push(Entry{q, order++, parent, nodes_[k].token, k, 0});
        }
    }
};

}  // namespace

constexpr size_t kLongInput = 64;  // tokens from which extend/add run without the GIL

PYBIND11_MODULE(_suffix_tree, m) {
    m.doc() = "Compiled suffix tree for SuffixDecoding; the reference is services/drafter/suffix_tree.py";
    py::class_<Matches>(m, "Matches")
        .def(py::init<>())
        .def("__len__", [](const Matches& x) { return x.items.size(); })
        .def("__bool__", [](const Matches& x) { return !x.items.empty(); });
    py::class_<SuffixTree>(m, "SuffixTree")
        .def(py::init<int>(), py::arg("max_depth") = 64)
        .def("new_seq", &SuffixTree::new_seq)
        // a long input (a prompt indexed by a request's own thread) is taken without the GIL, so
        // the scheduler's step goes on meanwhile; a few tokens are not worth the GIL's handover
        .def("extend",
             [](SuffixTree& t, int s, const std::vector<Tok>& tokens) {
                 if (tokens.size() < kLongInput) return t.extend(s, tokens);
                 py::gil_scoped_release unlocked;
                 t.extend(s, tokens);
             })
        .def("add",
             [](SuffixTree& t, const std::vector<Tok>& tokens) {
                 if (tokens.size() < kLongInput) return t.add(tokens);
                 py::gil_scoped_release unlocked;
                 return t.add(tokens);
             })
        .def("match", &SuffixTree::match)
        .def("advance", &SuffixTree::advance)
        .def("speculate", &SuffixTree::speculate)
        .def("speculate_matches", &SuffixTree::speculate_matches)
        .def("match_lengths", &SuffixTree::match_lengths)
        .def("count", &SuffixTree::count)
        .def_property_readonly("total", &SuffixTree::total)
        .def_property_readonly("num_nodes", &SuffixTree::num_nodes)
        .def_property_readonly("max_depth", &SuffixTree::max_depth);
    m.def("step_batch", &SuffixTree::step_batch, py::call_guard<py::gil_scoped_release>(),
          "One router step's suffix drafting for many sessions, without the GIL (SuffixTree::step_batch)");
    m.def("grow_live", &SuffixTree::grow_live, py::call_guard<py::gil_scoped_release>(),
          "A lagged step's shared-tree writes, without the GIL (SuffixTree::grow_live)");
}
