// The tree layer (DESIGN.md §1–3): every behaviour pinned with real values.
#include "treetensor/tree/tree.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

namespace tr = treetensor::tree;
using tr::Path;
using tr::Tree;
using tr::ZipMode;
using tr::ZipOptions;
using IntTree = Tree<int>;
using ListTree = Tree<std::vector<int>>;

// T = {a:1, b:2, x:{c:3, d:4}}: the issue's running example.
IntTree make_t() {
  return {{"a", 1}, {"b", 2}, {"x", {{"c", 3}, {"d", 4}}}};
}

// The message of the exception `fn` throws, checking its type; "" (and a failure) otherwise.
template <class E, class F>
std::string message_of(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type " << typeid(e).name() << ": " << e.what();
    return "";
  }
  ADD_FAILURE() << "no exception thrown";
  return "";
}

// An exception type no library code knows, to check that user errors pass through unchanged.
struct UserError {
  int code;
};

// The leaves of a tree in flatten order.
template <class T>
std::vector<T> leaves(const Tree<T>& t) {
  return tr::flatten(t).leaves;
}

// ---- construction and access ------------------------------------------------------------

TEST(TreeConstruct, NestedInitializerListSortsKeys) {
  IntTree t = {{"x", {{"d", 4}, {"c", 3}}}, {"b", 2}, {"a", 1}};
  EXPECT_EQ(t, make_t());
  std::vector<std::string> keys;
  for (const auto& [key, child] : t) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"a", "b", "x"}));
  EXPECT_EQ(t["x"].children()[0].first, "c");
  EXPECT_EQ(t["x"]["c"].leaf(), 3);
  EXPECT_EQ(t["x"]["d"].leaf(), 4);
}

TEST(TreeConstruct, LeafAndEmpty) {
  IntTree leaf = 7;
  EXPECT_TRUE(leaf.is_leaf());
  EXPECT_EQ(leaf.leaf(), 7);
  EXPECT_EQ(leaf.size(), 0u);
  EXPECT_EQ(leaf.depth(), 0u);
  EXPECT_EQ(leaf.leaf_count(), 1u);
  IntTree empty;
  EXPECT_FALSE(empty.is_leaf());
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.depth(), 0u);
  EXPECT_EQ(empty.leaf_count(), 0u);
  EXPECT_NE(empty, IntTree(0));
  ListTree shape = {2, 3};
  EXPECT_TRUE(shape.is_leaf());
  EXPECT_EQ(shape.leaf(), (std::vector<int>{2, 3}));
}

TEST(TreeConstruct, DuplicateKeyThrows) {
  auto build = [] { return IntTree{{"a", 1}, {"b", 2}, {"a", 3}}; };
  EXPECT_EQ(message_of<std::invalid_argument>(build), "duplicate tree key 'a'");
  IntTree::Children entries{{"k", 1}, {"k", 2}};
  EXPECT_EQ(message_of<std::invalid_argument>([&] { IntTree::from_children(entries); }),
            "duplicate tree key 'k'");
  IntTree::Children ok{{"b", 2}, {"a", 1}};
  EXPECT_EQ(IntTree::from_children(ok), (IntTree{{"a", 1}, {"b", 2}}));
}

TEST(TreeConstruct, FromFlatPathsInAnyOrder) {
  const IntTree expected = make_t();
  std::vector<std::pair<Path, int>> pairs{
      {Path{"x", "d"}, 4}, {Path{"a"}, 1}, {Path{"x", "c"}, 3}, {Path{"b"}, 2}};
  EXPECT_EQ(tr::unflatten<int>(pairs), expected);
  std::reverse(pairs.begin(), pairs.end());
  EXPECT_EQ(tr::unflatten<int>(pairs), expected);
  std::vector<std::pair<std::string, int>> dotted{{"x.c", 3}, {"b", 2}, {"x.d", 4}, {"a", 1}};
  EXPECT_EQ(tr::unflatten<int>(dotted), expected);
  // A lone root path is a leaf tree; no pairs is the empty tree.
  EXPECT_EQ(tr::unflatten<int>(std::vector<std::pair<Path, int>>{{Path{}, 5}}), IntTree(5));
  EXPECT_EQ(tr::unflatten<int>(std::vector<std::pair<Path, int>>{}), IntTree());
}

TEST(TreeConstruct, FromFlatPathsRejectsConflicts) {
  using Pairs = std::vector<std::pair<std::string, int>>;
  EXPECT_EQ(message_of<tr::StructureError>([] {
              tr::unflatten<int>(Pairs{{"a.b", 1}, {"a", 2}});
            }),
            "unflatten: path 'a' is both a leaf and the prefix of 'a.b'");
  EXPECT_EQ(message_of<tr::StructureError>([] {
              tr::unflatten<int>(Pairs{{"x.c", 1}, {"x.c", 2}});
            }),
            "unflatten: path 'x.c' appears twice");
  EXPECT_EQ(message_of<tr::StructureError>([] {
              tr::unflatten<int>(Pairs{{"", 1}, {"b", 2}});
            }),
            "unflatten: path '<root>' is both a leaf and the prefix of 'b'");
}

TEST(TreeAccess, ByKeyPathAndKeySequence) {
  IntTree t = make_t();
  EXPECT_EQ(t["a"].leaf(), 1);
  EXPECT_EQ(t["x"]["c"].leaf(), 3);
  EXPECT_EQ(t.at("x.c").leaf(), 3);
  EXPECT_EQ(t.at(Path{"x", "d"}).leaf(), 4);
  EXPECT_EQ(t.at(""), t);
  EXPECT_EQ(t.at("x"), (IntTree{{"c", 3}, {"d", 4}}));
  t.at("x.c").leaf() = 30;
  t["b"].leaf() = 20;
  EXPECT_EQ(t, (IntTree{{"a", 1}, {"b", 20}, {"x", {{"c", 30}, {"d", 4}}}}));
  const IntTree& ct = t;
  EXPECT_EQ(ct["x"]["c"].leaf(), 30);
  EXPECT_EQ(ct.at(Path{"x", "c"}).leaf(), 30);
  EXPECT_EQ(ct.find(Path{"x", "q"}), nullptr);
  EXPECT_EQ(ct.find(Path{"x", "d"})->leaf(), 4);
}

TEST(TreeAccess, MissingKeyNamesPathAndAvailableKeys) {
  const IntTree t = make_t();
  try {
    t.at("x.z");
    FAIL() << "no KeyError";
  } catch (const tr::KeyError& e) {
    EXPECT_STREQ(e.what(), "no key 'z' at path 'x.z'; available keys at 'x': {c, d}");
    EXPECT_EQ(e.path(), (Path{"x", "z"}));
    EXPECT_EQ(e.available(), (std::vector<std::string>{"c", "d"}));
  }
  EXPECT_EQ(message_of<tr::KeyError>([&] { t["q"]; }),
            "no key 'q' at path 'q'; available keys at '<root>': {a, b, x}");
  EXPECT_EQ(message_of<tr::KeyError>([&] {
              t.at(Path{"a", "b"});
            }),
            "no key 'b' at path 'a.b': 'a' is a leaf");
  // Chained access keeps the path walked from where the chain started.
  const IntTree deep = {{"model", {{"enc", {{"layer1", 1}}}}}};
  EXPECT_EQ(message_of<tr::KeyError>([&] { deep["model"]["enc"]["layer2"]; }),
            "no key 'layer2' at path 'model.enc.layer2'; available keys at 'model.enc': {layer1}");
  EXPECT_EQ(message_of<tr::KeyError>([&] { deep["model"].at("enc.layer2"); }),
            "no key 'layer2' at path 'model.enc.layer2'; available keys at 'model.enc': {layer1}");
  IntTree mutable_deep = deep;
  EXPECT_EQ(message_of<tr::KeyError>([&] { mutable_deep["model"]["enc"]["layer1"]["x"]; }),
            "no key 'x' at path 'model.enc.layer1.x': 'model.enc.layer1' is a leaf");
  try {
    deep["model"]["nope"];
    FAIL() << "no KeyError";
  } catch (const tr::KeyError& e) {
    EXPECT_EQ(e.path(), (Path{"model", "nope"}));
  }
  // A lookup on a node that the previous lookup did not return starts afresh.
  const IntTree& enc = deep["model"]["enc"];
  (void)t["x"];
  EXPECT_EQ(message_of<tr::KeyError>([&] { enc["q"]; }),
            "no key 'q' at path 'q'; available keys at '<root>': {layer1}");
  // KeyError is a std::out_of_range, so generic handlers catch it.
  EXPECT_THROW(t.at("nope"), std::out_of_range);
  EXPECT_EQ(message_of<tr::StructureError>([&] { t.leaf(); }),
            "tree node is not a leaf (it has 3 children)");
  EXPECT_EQ(message_of<tr::StructureError>([&] { t["a"].children(); }),
            "tree node is a leaf, it has no children");
}

TEST(TreeStructure, InsertEraseContainsSizeDepth) {
  IntTree t = make_t();
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(t.depth(), 2u);
  EXPECT_EQ(t.leaf_count(), 4u);
  EXPECT_FALSE(t.is_leaf());
  EXPECT_TRUE(t["a"].is_leaf());
  EXPECT_TRUE(t.contains("x.c"));
  EXPECT_TRUE(t.contains(Path{"x"}));
  EXPECT_TRUE(t.contains(""));
  EXPECT_FALSE(t.contains("x.e"));
  EXPECT_FALSE(t.contains("a.b"));  // runs through a leaf

  t.insert("y.z.w", 9);  // creates y and y.z
  EXPECT_EQ(t.at("y.z.w").leaf(), 9);
  EXPECT_EQ(t.depth(), 3u);
  t.insert(Path{"x", "c"}, 33);      // replaces
  t.insert("b", IntTree{{"e", 5}});  // a leaf replaced by a subtree
  EXPECT_EQ(
      t,
      (IntTree{
          {"a", 1}, {"b", {{"e", 5}}}, {"x", {{"c", 33}, {"d", 4}}}, {"y", {{"z", {{"w", 9}}}}}}));
  EXPECT_EQ(message_of<tr::KeyError>([&] { t.insert("a.q", 1); }),
            "cannot insert at 'a.q': 'a' is a leaf");
  EXPECT_EQ(message_of<tr::KeyError>([&] { t.insert(Path{}, 1); }),
            "cannot insert at the root path");

  EXPECT_TRUE(t.erase("y.z.w"));
  EXPECT_EQ(t["y"]["z"], IntTree());
  EXPECT_TRUE(t.erase(Path{"y"}));
  EXPECT_FALSE(t.erase("y"));
  EXPECT_FALSE(t.erase("a.q"));
  EXPECT_FALSE(t.erase(""));
  EXPECT_TRUE(t.erase("b"));
  EXPECT_EQ(t, (IntTree{{"a", 1}, {"x", {{"c", 33}, {"d", 4}}}}));
  EXPECT_EQ(t.size(), 2u);
}

TEST(TreeStructure, CopiesAreIndependentValues) {
  const IntTree t = make_t();
  IntTree u = t;
  u["x"]["c"].leaf() = 99;
  u.insert("x.e", 5);
  u.erase("a");
  EXPECT_EQ(t, make_t());
  EXPECT_EQ(u, (IntTree{{"b", 2}, {"x", {{"c", 99}, {"d", 4}, {"e", 5}}}}));
  IntTree w;
  w = u;
  w.insert("b", 7);
  EXPECT_EQ(u["b"].leaf(), 2);
  EXPECT_EQ(w["b"].leaf(), 7);
  IntTree moved = std::move(w);
  EXPECT_EQ(moved["b"].leaf(), 7);
}

TEST(TreeStructure, Equality) {
  EXPECT_EQ(make_t(), make_t());
  EXPECT_NE(make_t(), (IntTree{{"a", 1}, {"b", 2}, {"x", {{"c", 3}, {"d", 5}}}}));
  EXPECT_NE(make_t(), (IntTree{{"a", 1}, {"b", 2}, {"x", {{"c", 3}, {"e", 4}}}}));
  EXPECT_NE(make_t(), (IntTree{{"a", 1}, {"b", 2}, {"x", 3}}));
  EXPECT_NE(make_t(), (IntTree{{"a", 1}, {"b", 2}}));
  EXPECT_EQ(IntTree(), IntTree());
  EXPECT_EQ(IntTree(3), IntTree(3));
  EXPECT_NE(IntTree(3), IntTree(4));
}

TEST(TreeStructure, KeysWithDotsAndEmptyKeys) {
  IntTree t = {{"a.b", 1}, {"", 2}, {"n", {{"", 3}, {"c.d", 4}}}};
  EXPECT_EQ(t["a.b"].leaf(), 1);
  EXPECT_EQ(t[""].leaf(), 2);
  EXPECT_EQ(t.at(Path{"n", "c.d"}).leaf(), 4);
  EXPECT_EQ(t.at(Path{"n", ""}).leaf(), 3);
  EXPECT_FALSE(t.contains("a.b"));  // the dotted form splits; the key-sequence form does not
  EXPECT_TRUE(t.contains(Path{"a.b"}));
  auto flat = tr::flatten(t);
  EXPECT_EQ(flat.leaves, (std::vector<int>{2, 1, 3, 4}));
  EXPECT_EQ(flat.spec.paths(),
            (std::vector<Path>{Path{""}, Path{"a.b"}, Path{"n", ""}, Path{"n", "c.d"}}));
  EXPECT_EQ(tr::to_string(t),
            "<Tree>\n"
            "├── '' --> 2\n"
            "├── 'a.b' --> 1\n"
            "└── n --> <Tree>\n"
            "    ├── '' --> 3\n"
            "    └── 'c.d' --> 4");
  EXPECT_EQ(Path({"n", "c.d"}).str(), "n.'c.d'");
  EXPECT_EQ(Path({"n", ""}).describe(), "n.''");
  EXPECT_EQ(Path{}.describe(), "<root>");
  EXPECT_EQ(Path::parse("x.c"), (Path{"x", "c"}));
  EXPECT_EQ(Path::parse("x..c"), (Path{"x", "", "c"}));
  EXPECT_EQ(Path::parse(""), Path{});
  EXPECT_EQ(message_of<tr::KeyError>([&] {
              t.at(Path{"n", "c.e"});
            }),
            "no key 'c.e' at path 'n.'c.e''; available keys at 'n': {'', 'c.d'}");
  EXPECT_EQ(tr::unflatten<int>(std::vector<std::pair<Path, int>>{
                {Path{"n", "c.d"}, 4}, {Path{""}, 2}, {Path{"n", ""}, 3}, {Path{"a.b"}, 1}}),
            t);
}

TEST(TreeStructure, EmptyTrees) {
  const IntTree empty;
  EXPECT_EQ(tr::map([](int v) { return v + 1; }, empty), IntTree());
  EXPECT_EQ(tr::zip_map(std::plus<>{}, empty, empty), IntTree());
  EXPECT_EQ(empty + 1, IntTree());
  auto flat = tr::flatten(empty);
  EXPECT_TRUE(flat.leaves.empty());
  EXPECT_EQ(flat.spec.leaf_count(), 0u);
  EXPECT_EQ(flat.spec.node_count(), 1u);
  EXPECT_EQ(tr::unflatten(flat.spec, std::vector<int>{}), empty);
  EXPECT_EQ(tr::unflatten(tr::TreeSpec{}, std::vector<int>{}), empty);
  EXPECT_EQ(tr::filter([](int) { return true; }, empty), empty);
  EXPECT_EQ(tr::to_string(empty), "<Tree>");
  EXPECT_TRUE(tr::rise(ListTree()).empty());
  IntTree with_empty = {{"a", 1}, {"e", IntTree()}};
  EXPECT_EQ(with_empty.leaf_count(), 1u);
  EXPECT_EQ(with_empty.depth(), 1u);
  EXPECT_EQ(tr::flatten(with_empty).spec.paths(), std::vector<Path>{Path{"a"}});
  EXPECT_EQ(tr::unflatten(tr::flatten(with_empty).spec, std::vector<int>{5}),
            (IntTree{{"a", 5}, {"e", IntTree()}}));
  EXPECT_EQ(with_empty * 2, (IntTree{{"a", 2}, {"e", IntTree()}}));
}

// ---- leaf-wise operators ----------------------------------------------------------------

TEST(TreeOperators, IssueArithmeticExamples) {
  const IntTree t = make_t();
  const IntTree that = {{"a", 11}, {"b", 22}, {"x", {{"c", 33}, {"d", 5}}}};
  EXPECT_EQ(t + that, (IntTree{{"a", 12}, {"b", 24}, {"x", {{"c", 36}, {"d", 9}}}}));
  EXPECT_EQ(2 + t + that, (IntTree{{"a", 14}, {"b", 26}, {"x", {{"c", 38}, {"d", 11}}}}));
  EXPECT_EQ(6 / t, (IntTree{{"a", 6}, {"b", 3}, {"x", {{"c", 2}, {"d", 1}}}}));
  const Tree<double> pow2 = tr::map([](int v) { return std::pow(2.0, v); }, t);
  EXPECT_EQ(pow2, (Tree<double>{{"a", 2.0}, {"b", 4.0}, {"x", {{"c", 8.0}, {"d", 16.0}}}}));
}

TEST(TreeOperators, EveryOperatorLeafWise) {
  const IntTree t = make_t();
  EXPECT_EQ(leaves(t - 1), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(leaves(10 - t), (std::vector<int>{9, 8, 7, 6}));
  EXPECT_EQ(leaves(t * t), (std::vector<int>{1, 4, 9, 16}));
  EXPECT_EQ(leaves(t % 2), (std::vector<int>{1, 0, 1, 0}));
  EXPECT_EQ(leaves(t & 1), (std::vector<int>{1, 0, 1, 0}));
  EXPECT_EQ(leaves(t | 8), (std::vector<int>{9, 10, 11, 12}));
  EXPECT_EQ(leaves(t ^ 1), (std::vector<int>{0, 3, 2, 5}));
  EXPECT_EQ(leaves(1 << t), (std::vector<int>{2, 4, 8, 16}));
  EXPECT_EQ(leaves(t >> 1), (std::vector<int>{0, 1, 1, 2}));
  EXPECT_EQ(leaves(-t), (std::vector<int>{-1, -2, -3, -4}));
  EXPECT_EQ(leaves(+t), (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(leaves(~t), (std::vector<int>{-2, -3, -4, -5}));
  EXPECT_EQ(leaves(!(t - 1)), (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ(leaves(t < 3), (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ(leaves(t <= 3), (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(leaves(t > 2), (std::vector<bool>{false, false, true, true}));
  EXPECT_EQ(leaves(t >= 2), (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(leaves(t < 5 - t), (std::vector<bool>{true, true, false, false}));
  IntTree u = t;
  u += t;
  EXPECT_EQ(leaves(u), (std::vector<int>{2, 4, 6, 8}));
  u -= 1;
  EXPECT_EQ(leaves(u), (std::vector<int>{1, 3, 5, 7}));
  u *= 3;
  EXPECT_EQ(leaves(u), (std::vector<int>{3, 9, 15, 21}));
  u /= t;
  EXPECT_EQ(leaves(u), (std::vector<int>{3, 4, 5, 5}));
  u %= 4;
  EXPECT_EQ(leaves(u), (std::vector<int>{3, 0, 1, 1}));
  EXPECT_EQ(t, make_t());
  const Tree<double> half = t / 2.0;
  EXPECT_EQ(tr::flatten(half).leaves, (std::vector<double>{0.5, 1.0, 1.5, 2.0}));
}

TEST(TreeOperators, StructureMismatchThrows) {
  EXPECT_EQ(message_of<tr::StructureError>([] {
              make_t() + IntTree{{"a", 1}, {"b", 2}};
            }),
            "zip: key mismatch at '<root>': argument 0 has keys {a, b, x}, argument 1 has keys "
            "{a, b}");
}

// ---- map and zip-map --------------------------------------------------------------------

TEST(TreeMap, LeafAndPathForms) {
  const IntTree t = make_t();
  EXPECT_EQ(tr::map([](int v) { return v * 10; }, t),
            (IntTree{{"a", 10}, {"b", 20}, {"x", {{"c", 30}, {"d", 40}}}}));
  const Tree<std::string> named =
      tr::map([](const Path& p, int v) { return p.str() + "=" + std::to_string(v); }, t);
  EXPECT_EQ(named, (Tree<std::string>{
                       {"a", "a=1"}, {"b", "b=2"}, {"x", {{"c", "x.c=3"}, {"d", "x.d=4"}}}}));
  EXPECT_EQ(tr::map([](int v) { return v; }, IntTree(5)), IntTree(5));
  EXPECT_EQ(tr::map([](const Path& p, int) { return static_cast<int>(p.size()); }, IntTree(5)),
            IntTree(0));
}

TEST(TreeMap, ForEachVisitsInFlattenOrderAndMayModify) {
  IntTree t = make_t();
  std::vector<std::string> seen;
  tr::for_each(t, [&](const Path& p, int& v) {
    seen.push_back(p.str());
    v *= 2;
  });
  EXPECT_EQ(seen, (std::vector<std::string>{"a", "b", "x.c", "x.d"}));
  tr::for_each(t, [](int& v) { v += 1; });
  EXPECT_EQ(t, (IntTree{{"a", 3}, {"b", 5}, {"x", {{"c", 7}, {"d", 9}}}}));
}

TEST(TreeMap, UserExceptionsPropagateUnchanged) {
  const IntTree t = make_t();
  auto thrower = [](int v) -> int {
    if (v == 3) throw UserError{42};
    return v;
  };
  try {
    tr::map(thrower, t);
    FAIL() << "no exception";
  } catch (const UserError& e) {
    EXPECT_EQ(e.code, 42);
  }
  try {
    tr::zip_map([](int a, int b) -> int { throw std::domain_error(std::to_string(a + b)); }, t, t);
    FAIL() << "no exception";
  } catch (const std::domain_error& e) {
    EXPECT_STREQ(e.what(), "2");
  }
  EXPECT_THROW(tr::filter([](int v) -> bool { throw UserError{v}; }, t), UserError);
  EXPECT_THROW(tr::reduce(t, [](const auto&) -> int { throw UserError{1}; }), UserError);
  IntTree m = t;
  EXPECT_THROW(tr::for_each(m, [](int&) { throw UserError{2}; }), UserError);
}

TEST(TreeZip, ThreeTreesAndScalarsWithPaths) {
  const IntTree t = make_t();
  const IntTree u = t * 10;
  const IntTree got =
      tr::zip_map([](int a, int b, int s, int c) { return a + b + s * c; }, t, u, 100, t);
  EXPECT_EQ(got, (IntTree{{"a", 111}, {"b", 222}, {"x", {{"c", 333}, {"d", 444}}}}));
  const Tree<std::string> with_path = tr::zip_map(
      [](const Path& p, int a, int b) { return p.describe() + ":" + std::to_string(a * b); }, t, u);
  EXPECT_EQ(with_path.at("x.d").leaf(), "x.d:160");
  EXPECT_EQ(tr::zip_map(std::plus<>{}, IntTree(2), IntTree(3)), IntTree(5));
}

TEST(TreeZip, StrictMismatchNamesKeySetsAndPositions) {
  const IntTree ab = {{"a", 1}, {"b", 2}};
  const IntTree a = {{"a", 10}};
  EXPECT_EQ(message_of<tr::StructureError>([&] { tr::zip_map(std::plus<>{}, ab, a); }),
            "zip: key mismatch at '<root>': argument 0 has keys {a, b}, argument 1 has keys {a}");
  EXPECT_EQ(message_of<tr::StructureError>([&] { tr::zip_map(std::plus<>{}, a, ab); }),
            "zip: key mismatch at '<root>': argument 0 has keys {a}, argument 1 has keys {a, b}");
  // Positions count non-tree arguments too; the path names where the mismatch is.
  const IntTree deep_ab = {{"x", ab}};
  const IntTree deep_a = {{"x", a}};
  try {
    tr::zip_map([](int p, int q, int r) { return p + q + r; }, deep_ab, 5, deep_a);
    FAIL() << "no StructureError";
  } catch (const tr::StructureError& e) {
    EXPECT_STREQ(e.what(),
                 "zip: key mismatch at 'x': argument 0 has keys {a, b}, argument 2 has keys {a}");
    EXPECT_EQ(e.path(), Path{"x"});
  }
}

// zip compares keys index-wise word by word on its fast path: a difference in any byte of a key
// of any length must still be seen.
TEST(TreeZip, KeyDifferencesAtEveryPositionAreSeen) {
  const ZipOptions inner{.mode = ZipMode::inner};
  auto sum3 = [](int a, int b, int c) { return a + b + c; };
  for (std::size_t len = 0; len <= 20; ++len) {
    std::string key(len, 'k');
    for (std::size_t i = 0; i < len; ++i) key[i] = static_cast<char>('a' + i);
    const IntTree t = {{key, 1}, {"~", 2}};
    EXPECT_EQ(tr::zip_map(sum3, t, t, t), t * 3) << len;
    for (std::size_t pos = 0; pos < len; ++pos) {
      std::string other = key;
      other[pos] = 'Z';
      const IntTree u = {{other, 10}, {"~", 20}};
      EXPECT_THROW(tr::zip_map(std::plus<>{}, t, u), tr::StructureError) << len << " " << pos;
      EXPECT_EQ(tr::zip_map(inner, sum3, t, t, u), (IntTree{{"~", 24}})) << len << pos;
    }
    const IntTree longer = {{key + "x", 10}, {"~", 20}};
    EXPECT_THROW(tr::zip_map(std::plus<>{}, t, longer), tr::StructureError) << len;
  }
}

TEST(TreeZip, InnerKeepsCommonKeys) {
  const IntTree ab = {{"a", 1}, {"b", 2}};
  const IntTree a = {{"a", 10}};
  const ZipOptions inner{.mode = ZipMode::inner};
  EXPECT_EQ(tr::zip_map(inner, std::plus<>{}, ab, a), (IntTree{{"a", 11}}));
  EXPECT_EQ(tr::zip_map(inner, std::plus<>{}, a, ab), (IntTree{{"a", 11}}));
  const IntTree t1 = {{"a", 1}, {"x", {{"c", 3}, {"d", 4}}}, {"z", 0}};
  const IntTree t2 = {{"x", {{"d", 40}, {"e", 50}}}, {"z", 9}};
  EXPECT_EQ(tr::zip_map(inner, std::plus<>{}, t1, t2), (IntTree{{"x", {{"d", 44}}}, {"z", 9}}));
}

TEST(TreeZip, LeftUsesFirstTreesKeys) {
  const IntTree ab = {{"a", 1}, {"b", 2}};
  const IntTree a = {{"a", 10}};
  const IntTree ac = {{"a", 10}, {"c", 30}};
  const ZipOptions left{.mode = ZipMode::left};
  EXPECT_EQ(tr::zip_map(left, std::plus<>{}, a, ab), (IntTree{{"a", 11}}));
  EXPECT_EQ(tr::zip_map(left, std::plus<>{}, a, ac), (IntTree{{"a", 20}}));
  EXPECT_EQ(message_of<tr::StructureError>([&] { tr::zip_map(left, std::plus<>{}, ab, a); }),
            "zip: key mismatch at '<root>': argument 0 has keys {a, b}, argument 1 has keys {a} "
            "and no missing value was given");
  EXPECT_EQ(tr::zip_map(left, tr::missing(100), std::plus<>{}, ab, a),
            (IntTree{{"a", 11}, {"b", 102}}));
  EXPECT_EQ(tr::zip_map(left, tr::missing(100), std::plus<>{}, ab, ac),
            (IntTree{{"a", 11}, {"b", 102}}));
}

TEST(TreeZip, OuterFillsFromMissingOrThrows) {
  const IntTree ab = {{"a", 1}, {"b", 2}};
  const IntTree ac = {{"a", 10}, {"c", 30}};
  const ZipOptions outer{.mode = ZipMode::outer};
  EXPECT_EQ(tr::zip_map(outer, tr::missing(0), std::plus<>{}, ab, ac),
            (IntTree{{"a", 11}, {"b", 2}, {"c", 30}}));
  int calls = 0;
  EXPECT_EQ(
      tr::zip_map(outer, tr::missing_from([&] { return ++calls * 1000; }), std::plus<>{}, ab, ac),
      (IntTree{{"a", 11}, {"b", 1002}, {"c", 2030}}));
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(message_of<tr::StructureError>([&] { tr::zip_map(outer, std::plus<>{}, ab, ac); }),
            "zip: key mismatch at '<root>': argument 1 has keys {a, c}, argument 0 has keys "
            "{a, b} and no missing value was given");
}

TEST(TreeZip, OuterListsWithMissingAndInheritIssueExample) {
  // t1={a:2, x:{c:4, d:9}}, t2={a:4, b:48, x:{d:54}}, t3={b:-12, x:7, y:{e:3, f:4}}; every leaf
  // becomes a one-element list, absent leaves the empty list, and f concatenates.
  const IntTree t1 = {{"a", 2}, {"x", {{"c", 4}, {"d", 9}}}};
  const IntTree t2 = {{"a", 4}, {"b", 48}, {"x", {{"d", 54}}}};
  const IntTree t3 = {{"b", -12}, {"x", 7}, {"y", {{"e", 3}, {"f", 4}}}};
  auto lists = [](const IntTree& t) {
    return tr::map([](int v) { return std::vector<int>{v}; }, t);
  };
  auto append = [](std::vector<int> a, const std::vector<int>& b, const std::vector<int>& c) {
    a.insert(a.end(), b.begin(), b.end());
    a.insert(a.end(), c.begin(), c.end());
    return a;
  };
  const ListTree got =
      tr::zip_map(ZipOptions{.mode = ZipMode::outer, .inherit = true},
                  tr::missing(std::vector<int>{}), append, lists(t1), lists(t2), lists(t3));
  const ListTree expected = {{"a", {2, 4}},
                             {"b", {48, -12}},
                             {"x", {{"c", {4, 7}}, {"d", {9, 54, 7}}}},
                             {"y", {{"e", {3}}, {"f", {4}}}}};
  EXPECT_EQ(got, expected);
}

TEST(TreeZip, LeafFacingSubtreeNeedsInherit) {
  const IntTree t = make_t();
  const IntTree flat_x = {{"a", 10}, {"b", 20}, {"x", 100}};
  EXPECT_EQ(message_of<tr::StructureError>([&] { tr::zip_map(std::plus<>{}, t, flat_x); }),
            "zip: at 'x' argument 1 is a leaf but argument 0 is a subtree with keys {c, d}; pass "
            "inherit to broadcast the leaf into the subtree");
  EXPECT_EQ(tr::zip_map(ZipOptions{.inherit = true}, std::plus<>{}, t, flat_x),
            (IntTree{{"a", 11}, {"b", 22}, {"x", {{"c", 103}, {"d", 104}}}}));
  EXPECT_EQ(tr::zip_map(ZipOptions{.inherit = true}, std::minus<>{}, flat_x, t),
            (IntTree{{"a", 9}, {"b", 18}, {"x", {{"c", 97}, {"d", 96}}}}));
  // A whole-tree leaf argument broadcasts like a scalar when inherit is on.
  EXPECT_EQ(tr::zip_map(ZipOptions{.inherit = true}, std::plus<>{}, IntTree(1000), t), 1000 + t);
  EXPECT_THROW(tr::zip_map(std::plus<>{}, IntTree(1000), t), tr::StructureError);
}

// ---- filter, mask, reduce -------------------------------------------------------------

TEST(TreeFilter, IssueExamples) {
  const IntTree t = make_t();
  EXPECT_EQ(tr::filter([](int v) { return v % 2 == 1; }, t),
            (IntTree{{"a", 1}, {"x", {{"c", 3}}}}));
  EXPECT_EQ(tr::filter([](int v) { return v < 3; }, t), (IntTree{{"a", 1}, {"b", 2}}));
  EXPECT_EQ(tr::filter([](int v) { return v < 3; }, t, {.keep_empty = true}),
            (IntTree{{"a", 1}, {"b", 2}, {"x", IntTree()}}));
  EXPECT_EQ(tr::filter([](const Path& p, int) { return p.size() == 2; }, t),
            (IntTree{{"x", {{"c", 3}, {"d", 4}}}}));
  EXPECT_EQ(tr::filter([](int) { return false; }, t), IntTree());
  EXPECT_EQ(tr::filter([](int v) { return v > 0; }, IntTree(4)), IntTree(4));
  EXPECT_EQ(tr::filter([](int v) { return v < 0; }, IntTree(4)), IntTree());
}

TEST(TreeFilter, MaskByFlagTree) {
  const IntTree t = make_t();
  const Tree<bool> keep = {{"a", false}, {"b", true}, {"x", {{"c", false}, {"d", false}}}};
  EXPECT_EQ(tr::mask(t, keep), (IntTree{{"b", 2}}));
  EXPECT_EQ(tr::mask(t, keep, {.keep_empty = true}), (IntTree{{"b", 2}, {"x", IntTree()}}));
  EXPECT_EQ(tr::mask(t, t > 2), (IntTree{{"x", {{"c", 3}, {"d", 4}}}}));
  EXPECT_THROW(tr::mask(t, Tree<bool>{{"a", true}}), tr::StructureError);
}

TEST(TreeReduce, SumAndProduct) {
  auto sum = [](const auto& children) {
    int s = 0;
    for (const auto& [key, value] : children) s += value;
    return s;
  };
  auto product = [](const auto& children) {
    int p = 1;
    for (const auto& [key, value] : children) p *= value;
    return p;
  };
  const IntTree sums = {{"a", 13}, {"b", 27}, {"x", {{"c", 39}, {"d", 45}}}};
  EXPECT_EQ(tr::reduce(sums, sum), 124);
  EXPECT_EQ(tr::reduce(make_t(), product), 24);
  EXPECT_EQ(tr::reduce(IntTree(7), sum), 7);
  // The two-function form maps leaves first and sees keys in sorted order.
  const std::string keys = tr::reduce(
      make_t(), [](int v) { return std::to_string(v); },
      [](const std::vector<std::pair<std::string_view, std::string>>& children) {
        std::string out = "(";
        for (const auto& [key, value] : children) out += std::string(key) + ":" + value + " ";
        return out + ")";
      });
  EXPECT_EQ(keys, "(a:1 b:2 x:(c:3 d:4 ) )");
}

// ---- flatten, unflatten, spec -----------------------------------------------------------

TEST(TreeFlatten, OrderPathsAndRoundTrip) {
  const IntTree t = make_t();
  const auto flat = tr::flatten(t);
  EXPECT_EQ(flat.leaves, (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(flat.spec.paths(),
            (std::vector<Path>{Path{"a"}, Path{"b"}, Path{"x", "c"}, Path{"x", "d"}}));
  EXPECT_EQ(t.paths(), flat.spec.paths());
  EXPECT_EQ(flat.spec.leaf_count(), 4u);
  EXPECT_EQ(flat.spec.node_count(), 6u);
  EXPECT_EQ(tr::unflatten(flat.spec, flat.leaves), t);
  EXPECT_EQ(tr::unflatten(flat.spec, std::vector<int>{5, 6, 7, 8}),
            (IntTree{{"a", 5}, {"b", 6}, {"x", {{"c", 7}, {"d", 8}}}}));
  const auto refs = tr::flatten_refs(t);
  ASSERT_EQ(refs.leaves.size(), 4u);
  EXPECT_EQ(refs.leaves[2], &t.at("x.c").leaf());
  EXPECT_EQ(refs.spec, flat.spec);
  IntTree m = t;
  for (int* p : tr::flatten_mut(m).leaves) *p *= -1;
  EXPECT_EQ(m, -t);
  std::vector<int> taken;
  EXPECT_EQ((tr::Flattener<int, int>::run(t, [&](int v) { taken.push_back(v); })), flat.spec);
  EXPECT_EQ(taken, flat.leaves);
  const auto leaf = tr::flatten(IntTree(9));
  EXPECT_EQ(leaf.leaves, std::vector<int>{9});
  EXPECT_EQ(leaf.spec.paths(), std::vector<Path>{Path{}});
  EXPECT_EQ(tr::unflatten(leaf.spec, std::vector<int>{10}), IntTree(10));
}

TEST(TreeFlatten, UnflattenFromShuffledPairs) {
  const IntTree t = make_t();
  const auto flat = tr::flatten(t);
  const auto paths = flat.spec.paths();
  std::vector<std::pair<Path, int>> pairs;
  for (std::size_t i = 0; i < paths.size(); ++i) pairs.emplace_back(paths[i], flat.leaves[i]);
  std::mt19937 rng(7);
  for (int round = 0; round < 10; ++round) {
    std::shuffle(pairs.begin(), pairs.end(), rng);
    EXPECT_EQ(tr::unflatten<int>(pairs), t);
  }
}

// Leaves from a single-pass input iterator (std::istream_iterator): each read once, in
// flatten order.
TEST(TreeFlatten, UnflattenFromAnInputIterator) {
  const auto flat = tr::flatten(make_t());
  std::istringstream in("5 6 7 8 9");
  std::istream_iterator<int> it(in);
  EXPECT_EQ(tr::unflatten<int>(flat.spec, it),
            (IntTree{{"a", 5}, {"b", 6}, {"x", {{"c", 7}, {"d", 8}}}}));
  const std::vector<int> leaf{10, 11};
  EXPECT_EQ(tr::unflatten<int>(tr::flatten(IntTree(9)).spec, leaf.begin()), IntTree(10));
  EXPECT_EQ(tr::unflatten<int>(tr::TreeSpec{}, leaf.begin()), IntTree());
}

TEST(TreeFlatten, WrongLeafCountThrows) {
  const auto spec = tr::flatten(make_t()).spec;
  EXPECT_EQ(message_of<tr::StructureError>([&] {
              tr::unflatten(spec, std::vector<int>{1, 2, 3});
            }),
            "unflatten: the spec has 4 leaves but 3 were given");
}

TEST(TreeFlatten, SpecEqualityAndHash) {
  const auto s1 = tr::flatten(make_t()).spec;
  const auto s2 = tr::flatten(make_t() * 7).spec;
  const auto s3 = tr::flatten(IntTree{{"a", 1}, {"b", 2}, {"x", {{"c", 3}, {"e", 4}}}}).spec;
  const auto s4 = tr::flatten(IntTree{{"a", 1}, {"b", 2}, {"x", {{"c", 3}}}}).spec;
  const auto s5 = tr::flatten(IntTree{{"a", 1}, {"b", 2}, {"x", 3}}).spec;
  const auto s6 =
      tr::flatten(Tree<std::string>{{"a", "p"}, {"b", "q"}, {"x", {{"c", "r"}, {"d", "s"}}}}).spec;
  EXPECT_EQ(s1, s2);
  EXPECT_EQ(s1, s6);  // the spec is the structure only, whatever the leaf type
  EXPECT_EQ(s1.hash(), s2.hash());
  EXPECT_EQ(s1.hash(), s6.hash());
  EXPECT_EQ(std::hash<tr::TreeSpec>{}(s1), s1.hash());
  for (const auto* other : {&s3, &s4, &s5}) {
    EXPECT_NE(s1, *other);
    EXPECT_NE(s1.hash(), other->hash());
  }
  EXPECT_NE(tr::flatten(IntTree()).spec, tr::flatten(IntTree(1)).spec);
  EXPECT_EQ(tr::TreeSpec{}, tr::TreeSpec{});
  EXPECT_NE(tr::TreeSpec{}, s1);
  tr::TreeSpec copy = s1;
  EXPECT_EQ(copy, s1);
  std::unordered_set<tr::TreeSpec> set{s1, s2, s3, s4, s5};
  EXPECT_EQ(set.size(), 4u);
}

// ---- subside, rise, union ---------------------------------------------------------------

TEST(TreeSubside, SubsideThenRiseRoundTrips) {
  const std::vector<IntTree> trees{make_t(), make_t() * 10, make_t() + 100};
  const ListTree sub = tr::subside(trees);
  EXPECT_EQ(sub, (ListTree{{"a", {1, 10, 101}},
                           {"b", {2, 20, 102}},
                           {"x", {{"c", {3, 30, 103}}, {"d", {4, 40, 104}}}}}));
  EXPECT_EQ(tr::rise(sub), trees);
  EXPECT_EQ(tr::rise(tr::subside(std::vector<IntTree>{IntTree(3), IntTree(4)})),
            (std::vector<IntTree>{IntTree(3), IntTree(4)}));
}

TEST(TreeSubside, Errors) {
  const std::vector<IntTree> bad{make_t(), IntTree{{"a", 1}, {"b", 2}, {"x", {{"c", 3}}}}};
  EXPECT_EQ(message_of<tr::StructureError>([&] { tr::subside(bad); }),
            "subside: at 'x' tree 0 has keys {c, d} but tree 1 has keys {c}");
  const std::vector<IntTree> leafy{make_t(), IntTree{{"a", 1}, {"b", 2}, {"x", 3}}};
  EXPECT_EQ(message_of<tr::StructureError>([&] { tr::subside(leafy); }),
            "subside: at 'x' tree 0 has keys {c, d} but tree 1 has a leaf");
  EXPECT_THROW(tr::subside(std::vector<IntTree>{}), std::invalid_argument);
  const ListTree ragged = {{"a", {1, 2}}, {"x", {{"c", {3}}}}};
  EXPECT_EQ(message_of<tr::StructureError>([&] { tr::rise(ragged); }),
            "rise: leaf 'x.c' has 1 elements, the first leaf has 2");
}

TEST(TreeSubside, RiseOfTuples) {
  const Tree<std::pair<int, std::string>> pairs = {
      {"a", std::pair<int, std::string>{1, "one"}},
      {"x", {{"c", std::pair<int, std::string>{3, "three"}}}}};
  const auto [ints, names] = tr::rise(pairs);
  EXPECT_EQ(ints, (IntTree{{"a", 1}, {"x", {{"c", 3}}}}));
  EXPECT_EQ(names, (Tree<std::string>{{"a", "one"}, {"x", {{"c", "three"}}}}));
  const Tree<std::tuple<int, double, char>> triples = {
      {"a", std::tuple<int, double, char>{1, 0.5, 'p'}},
      {"b", std::tuple<int, double, char>{2, 1.5, 'q'}}};
  const auto [i, d, c] = tr::rise(triples);
  EXPECT_EQ(i, (IntTree{{"a", 1}, {"b", 2}}));
  EXPECT_EQ(d, (Tree<double>{{"a", 0.5}, {"b", 1.5}}));
  EXPECT_EQ(c, (Tree<char>{{"a", 'p'}, {"b", 'q'}}));
}

TEST(TreeSubside, UnionZipsLeavesIntoTuples) {
  const IntTree t = make_t();
  const Tree<std::string> s = tr::map([](int v) { return std::string(v, '*'); }, t);
  const auto u = tr::union_(t, s, t * 2);
  EXPECT_EQ(u.at("x.c").leaf(), (std::tuple<int, std::string, int>{3, "***", 6}));
  EXPECT_EQ(u.at("a").leaf(), (std::tuple<int, std::string, int>{1, "*", 2}));
  const auto [back_t, back_s, back_2t] = tr::rise(u);
  EXPECT_EQ(back_t, t);
  EXPECT_EQ(back_s, s);
  EXPECT_EQ(back_2t, t * 2);
  EXPECT_THROW(tr::union_(t, IntTree{{"a", 1}}), tr::StructureError);
}

// ---- printing ---------------------------------------------------------------------------

TEST(TreePrint, LayoutWithGlyphs) {
  EXPECT_EQ(tr::to_string(make_t()),
            "<Tree>\n"
            "├── a --> 1\n"
            "├── b --> 2\n"
            "└── x --> <Tree>\n"
            "    ├── c --> 3\n"
            "    └── d --> 4");
  const IntTree nested = {{"m", {{"p", {{"q", 1}}}, {"r", 2}}}, {"z", 3}};
  EXPECT_EQ(tr::to_string(nested),
            "<Tree>\n"
            "├── m --> <Tree>\n"
            "│   ├── p --> <Tree>\n"
            "│   │   └── q --> 1\n"
            "│   └── r --> 2\n"
            "└── z --> 3");
  EXPECT_EQ(tr::to_string(IntTree(5)), "5");
  EXPECT_EQ(tr::to_string(IntTree{{"e", IntTree()}}), "<Tree>\n└── e --> <Tree>");
}

TEST(TreePrint, MultiLineLeavesIndentUnderTheArrow) {
  const Tree<std::string> t = {{"ab", "line1\nline2"}, {"x", {{"key", "p\nq\nr"}}}};
  EXPECT_EQ(tr::to_string(t),
            "<Tree>\n"
            "├── ab --> line1\n"
            "│          line2\n"
            "└── x --> <Tree>\n"
            "    └── key --> p\n"
            "                q\n"
            "                r");
}

// Keys that are empty or hold '.' would read as another tree: quoted, as paths quote them.
TEST(TreePrint, AmbiguousKeysAreQuoted) {
  IntTree t;
  t.insert(Path{""}, 1);
  t.insert(Path{"a.b"}, 2);
  t.insert(Path{"n", "x.y"}, 3);
  EXPECT_EQ(tr::to_string(t),
            "<Tree>\n"
            "├── '' --> 1\n"
            "├── 'a.b' --> 2\n"
            "└── n --> <Tree>\n"
            "    └── 'x.y' --> 3");
  const Tree<std::string> multi = {{"p.q", "l1\nl2"}};
  EXPECT_EQ(tr::to_string(multi), "<Tree>\n└── 'p.q' --> l1\n              l2");
}

TEST(TreePrint, CustomHeaderFormatterAndDefaultLeafFormats) {
  std::ostringstream os;
  tr::print(os, make_t(), "<T>", [](std::ostream& o, int v) { o << "#" << v; });
  EXPECT_EQ(os.str(),
            "<T>\n├── a --> #1\n├── b --> #2\n└── x --> <T>\n    ├── c --> #3\n    └── d --> #4");
  const ListTree lists = {{"s", {2, 3}}};
  EXPECT_EQ(tr::to_string(lists), "<Tree>\n└── s --> [2, 3]");
  const Tree<std::pair<int, std::vector<int>>> pairs = {
      {"p", std::pair<int, std::vector<int>>{1, {2}}}};
  EXPECT_EQ(tr::to_string(pairs), "<Tree>\n└── p --> (1, [2])");
}

// ---- size: wide and deep trees ----------------------------------------------------------

TEST(TreeScale, TenThousandLeaves) {
  std::vector<std::pair<std::string, int>> pairs;
  for (int i = 0; i < 100; ++i)
    for (int j = 0; j < 100; ++j)
      pairs.emplace_back("g" + std::to_string(i) + ".l" + std::to_string(j), i * 100 + j);
  std::shuffle(pairs.begin(), pairs.end(), std::mt19937(3));
  const IntTree t = tr::unflatten<int>(pairs);
  EXPECT_EQ(t.leaf_count(), 10000u);
  EXPECT_EQ(t.size(), 100u);
  EXPECT_EQ(t.at("g42.l7").leaf(), 4207);
  const auto flat = tr::flatten(t);
  ASSERT_EQ(flat.leaves.size(), 10000u);
  // Sorted string keys: g0, g1, g10, g11, ..., so check order against a sorted key list.
  std::vector<std::pair<Path, int>> by_path;
  for (const auto& [p, v] : pairs) by_path.emplace_back(Path::parse(p), v);
  std::sort(by_path.begin(), by_path.end());
  const auto paths = flat.spec.paths();
  for (std::size_t i = 0; i < by_path.size(); ++i) {
    ASSERT_EQ(paths[i], by_path[i].first);
    ASSERT_EQ(flat.leaves[i], by_path[i].second);
  }
  const IntTree doubled = t + t;
  EXPECT_EQ(tr::reduce(doubled,
                       [](const auto& c) {
                         long s = 0;
                         for (const auto& kv : c) s += kv.second;
                         return static_cast<int>(s);
                       }),
            2 * (9999 * 10000 / 2));
  EXPECT_EQ(tr::unflatten(flat.spec, flat.leaves), t);
  const std::string printed = tr::to_string(t);
  EXPECT_EQ(std::count(printed.begin(), printed.end(), '\n'), 10100);
}

// A chain {k: {k: ... {k: 1}}} of the given depth, built without recursion.
IntTree chain(std::size_t depth) {
  IntTree t = 1;
  for (std::size_t i = 0; i < depth; ++i) {
    IntTree parent;
    parent.children().emplace_back("k", std::move(t));
    t = std::move(parent);
  }
  return t;
}

// Counts characters and lines without storing them (printing a deep chain is quadratic).
class CountingBuf : public std::streambuf {
 public:
  std::size_t chars = 0, lines = 0;

 protected:
  int_type overflow(int_type c) override {
    ++chars;
    if (c == '\n') ++lines;
    return c;
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    chars += static_cast<std::size_t>(n);
    lines += static_cast<std::size_t>(std::count(s, s + n, '\n'));
    return n;
  }
};

// What walks iteratively (any depth): structure queries, flatten/unflatten, paths, printing,
// destruction; copies and == recurse but are tested to 10,000 levels too.
void check_deep_structure(std::size_t depth) {
  IntTree t = chain(depth);
  EXPECT_EQ(t.depth(), depth);
  EXPECT_EQ(t.leaf_count(), 1u);
  const Path deepest(std::vector<std::string>(depth, "k"));
  EXPECT_EQ(t.at(deepest).leaf(), 1);
  EXPECT_TRUE(t.contains(deepest));
  const auto flat = tr::flatten(t);
  EXPECT_EQ(flat.leaves, std::vector<int>{1});
  EXPECT_EQ(flat.spec.node_count(), depth + 1);
  EXPECT_EQ(flat.spec.paths(), std::vector<Path>{deepest});
  EXPECT_EQ(t.paths(), std::vector<Path>{deepest});
  IntTree back = tr::unflatten(flat.spec, std::vector<int>{2});
  EXPECT_EQ(back.at(deepest).leaf(), 2);
  back.at(deepest).leaf() = 1;
  EXPECT_EQ(back, t);
  IntTree copy = t;
  copy.at(deepest).leaf() = 3;
  EXPECT_EQ(t.at(deepest).leaf(), 1);
  EXPECT_NE(copy, t);
  // Line i (1-based, i <= depth) is 4*(i-1) spaces + "└── k --> <Tree>"; the glyph is 3 bytes.
  CountingBuf buf;
  std::ostream os(&buf);
  os << t;
  const std::size_t arrow_line = 10 + 1 + 5;  // "└── " (3 glyphs of 3 bytes, a space), "k", " --> "
  std::size_t expected = 6;                   // the "<Tree>" header
  for (std::size_t i = 1; i <= depth; ++i)
    expected += 1 + 4 * (i - 1) + arrow_line + (i < depth ? 6 : 1);
  EXPECT_EQ(buf.lines, depth);
  EXPECT_EQ(buf.chars, expected);
  // Destruction (of t, back, copy and flat's spec) at scope exit must not overflow either.
}

// The recursive algorithms (one call per level, see Tree's documentation).
void check_deep_algorithms(std::size_t depth) {
  const IntTree t = chain(depth);
  const Path deepest(std::vector<std::string>(depth, "k"));
  EXPECT_EQ((t + t).at(deepest).leaf(), 2);
  EXPECT_EQ(tr::zip_map(ZipOptions{.mode = ZipMode::outer}, tr::missing(0), std::plus<>{}, t, t)
                .at(deepest)
                .leaf(),
            2);
  EXPECT_EQ(tr::map([](int v) { return v * 5; }, t).at(deepest).leaf(), 5);
  EXPECT_EQ(tr::filter([](int v) { return v > 1; }, t), IntTree());
  EXPECT_EQ(tr::filter([](int v) { return v > 0; }, t), t);
  EXPECT_EQ(tr::reduce(t, [](const auto& c) { return c[0].second + 1; }),
            static_cast<int>(depth) + 1);
  EXPECT_EQ(tr::rise(tr::subside(std::vector<IntTree>{t, t})), (std::vector<IntTree>{t, t}));
}

TEST(TreeScale, TwoHundredDeep) {
  check_deep_structure(200);
  check_deep_algorithms(200);
}

TEST(TreeScale, TenThousandDeepFlattenPrintDestroy) {
  check_deep_structure(10000);
}

// The second error channel (DESIGN.md §3): a failed invariant names file:line and asks for a
// bug report, and is not a user error type.
TEST(InternalError, CarriesFileLineAndAsksForAReport) {
  try {
    TREETENSOR_INTERNAL_ASSERT(1 + 1 == 3, "arithmetic");
    FAIL() << "no throw";
  } catch (const treetensor::InternalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tree_test.cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find("'1 + 1 == 3' failed: arithmetic"), std::string::npos) << what;
    EXPECT_NE(what.find("bug in treetensor, please report"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(TREETENSOR_INTERNAL_ASSERT(true));
  static_assert(!std::is_base_of_v<std::invalid_argument, treetensor::InternalError>);
}

}  // namespace
