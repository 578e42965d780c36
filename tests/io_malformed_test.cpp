// The malformed-input table (DESIGN.md §13): one case per check of the zip, pickle, legacy and
// safetensors readers. Each must raise io::IoError naming the file and what is wrong — never a
// crash, a hang or an allocation the file does not justify.
#include <caffe2/serialize/inline_container.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "io_test_util.hpp"
#include "pickle_bytes.hpp"
#include "treetensor/io/safetensors.hpp"

using namespace io_test;
using namespace std::string_literals;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

class Malformed : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch(::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& bytes) {
    const std::string p = (dir_ / name).string();
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  // A zip archive as torch.save lays it out, with our own data.pkl and records.
  std::string archive(const std::string& name, const std::string& pickle,
                      const std::map<std::string, std::string>& records = {
                          {"data/0", std::string(8, '\0')}}) {
    const std::string p = (dir_ / name).string();
    caffe2::serialize::PyTorchStreamWriter w(p);
    w.writeRecord("data.pkl", pickle.data(), pickle.size());
    for (const auto& [k, v] : records) w.writeRecord(k, v.data(), v.size());
    w.writeEndOfFile();
    return p;
  }
  std::filesystem::path dir_;
};

// The message of the IoError that loading `path` raises ("" and a failure when none).
template <class F>
std::string error_of(F&& load, const std::string& path) {
  try {
    load(path);
  } catch (const io::IoError& e) {
    EXPECT_EQ(e.file(), path);
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an IoError: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error for " << path;
  return "";
}
std::string load_error(const std::string& path) {
  return error_of([](const std::string& p) { io::load(p); }, path);
}
std::string safetensors_error(const std::string& path) {
  return error_of([](const std::string& p) { io::load_safetensors(p); }, path);
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

// ---- pickle bytes, written as torch.save writes them ----------------------------------------
using pickle_bytes::integer;
using pickle_bytes::ints;
using pickle_bytes::str;
using pickle_bytes::tensor_pickle;
using pickle_bytes::u32;

}  // namespace

TEST_F(Malformed, ZipStructure) {
  const std::string good = read_file(fixture("plain_tensor.pt"));
  EXPECT_HAS(load_error(write("empty.pt", "")),
             "neither a zip-format nor a legacy torch.save file");
  for (std::size_t cut : {std::size_t{10}, good.size() / 2, good.size() - 10, good.size() - 22}) {
    SCOPED_TRACE("truncated at " + std::to_string(cut));
    EXPECT_HAS(load_error(write("cut.pt", good.substr(0, cut))), "cut.pt: ");
  }
  // The central directory's offset points past the end.
  std::string far = good;
  const std::size_t end = far.rfind(std::string("PK\x05\x06", 4));
  ASSERT_NE(end, std::string::npos);
  far.replace(end + 16, 4, u32(0x7fffffff));
  EXPECT_HAS(load_error(write("far.pt", far)), "lies outside the file");
  // A compressed record (method 8, deflate) in the central directory.
  std::string deflated = good;
  const std::size_t central = deflated.find(std::string("PK\x01\x02", 4));
  deflated[central + 10] = 8;
  EXPECT_HAS(load_error(write("deflate.pt", deflated)), "is compressed (method 8)");
  {
    const std::string nopkl = (dir_ / "nopkl.pt").string();
    caffe2::serialize::PyTorchStreamWriter w(nopkl);
    w.writeRecord("x", "y", 1);
    w.writeEndOfFile();
    EXPECT_HAS(load_error(nopkl), "without a data.pkl record");
  }
  EXPECT_HAS(load_error(archive("bigendian.pt", tensor_pickle({2}, {1}),
                                {{"data/0", std::string(8, '\0')}, {"byteorder", "big"}})),
             "byteorder 'big': only little-endian");
}

TEST_F(Malformed, PickleOpcodesAndGlobals) {
  EXPECT_HAS(load_error(archive("os.pt",
                                "\x80\x02"
                                "cos\nsystem\n" +
                                    str("ls") + "\x85R.")),
             "global 'os.system' is not allowed");
  EXPECT_HAS(load_error(archive("eval.pt",
                                "\x80\x02"
                                "cbuiltins\neval\n" +
                                    str("1") + "\x85R.")),
             "global 'builtins.eval' is not allowed");
  EXPECT_HAS(load_error(archive("inst.pt", "\x80\x02(i__main__\nX\n.")),
             "opcode 0x69 ('i') is not allowed");
  // A tree as torch.save writes it, treetensor.torch._tree(dict); never the class by NEWOBJ.
  EXPECT_HAS(load_error(archive("tree_none.pt",
                                "\x80\x02"
                                "ctreetensor.torch\n_tree\nN\x85R.")),
             "treetensor.torch._tree of a value that is not a dict");
  EXPECT_HAS(load_error(archive("newobj.pt",
                                "\x80\x02"
                                "ctreetensor._C\nTensor\n)\x81.")),
             "global 'treetensor._C.Tensor' is not allowed");
  EXPECT_HAS(load_error(archive("memo.pt", "\x80\x02h\x05.")), "memo key 5 was never stored");
  EXPECT_HAS(load_error(archive("mark.pt", "\x80\x02N\x88t.")), "TUPLE without a MARK");
  EXPECT_HAS(load_error(archive("under.pt", "\x80\x02s.")), "stack underflow at SETITEM");
  EXPECT_HAS(load_error(archive("nostop.pt", "\x80\x02}")), "the pickle has no STOP");
  EXPECT_HAS(load_error(archive("two.pt", "\x80\x02NN.")), "2 values on the stack");
  EXPECT_HAS(load_error(archive("long.pt", "\x80\x02\x8a\x09" + std::string(9, '\x01') + ".")),
             "out of the int64 range");
  EXPECT_HAS(load_error(archive("str.pt", "\x80\x02X" + u32(0x7fffffff) + "abc.")),
             "the input ends inside a BINUNICODE string (2147483647 bytes wanted");
  EXPECT_HAS(load_error(archive("proto.pt", "\x80\x09N.")), "pickle protocol 9");
  EXPECT_HAS(load_error(archive("call.pt",
                                "\x80\x02"
                                "ctorch\nfloat32\n)R.")),
             "REDUCE of a value that is not a callable global");
  // 2000 nested lists: refused at depth 1000 instead of exhausting the stack.
  std::string deep = "\x80\x02" + std::string(2000, ']') + std::string(1999, 'a') + ".";
  EXPECT_HAS(load_error(archive("deep.pt", deep)), "nesting deeper than 1000");
  // A list that contains itself: the same limit, no hang and no leak.
  EXPECT_HAS(load_error(archive("cycle.pt",
                                "\x80\x02]q\x01h\x01"
                                "a.")),
             "nesting deeper than 1000");
}

TEST_F(Malformed, TensorsAndStorages) {
  EXPECT_HAS(load_error(archive("past.pt", tensor_pickle({10}, {1}))),
             "at 't': the tensor reaches past its storage '0' (8 bytes)");
  EXPECT_HAS(load_error(archive("offset.pt", tensor_pickle({2}, {1}, 1))),
             "reaches past its storage");
  EXPECT_HAS(load_error(archive("negative.pt", tensor_pickle({-2}, {1}))),
             "negative size or stride in dim 0");
  EXPECT_HAS(load_error(archive("stride.pt", tensor_pickle({2, 2}, {1, -1}))),
             "negative size or stride in dim 1");
  EXPECT_HAS(load_error(archive("huge.pt", tensor_pickle({std::int64_t{1} << 62, 4}, {4, 1}))),
             "overflows");
  // Stride 0 keeps the extent in the storage; the element and byte counts must still fit int64.
  for (const auto& size : {std::vector<std::int64_t>{3, std::int64_t{1} << 62},
                           std::vector<std::int64_t>{std::int64_t{1} << 62}}) {
    const std::vector<std::int64_t> zeros(size.size(), 0);
    const std::string e = load_error(archive("zero.pt", tensor_pickle(size, zeros)));
    EXPECT_HAS(e, "zero.pt: at 't': a tensor of ");
    EXPECT_HAS(e, "more bytes than int64 counts");
  }
  EXPECT_HAS(load_error(archive("numel.pt", tensor_pickle({2}, {1}, 0, 1000))),
             "storage '0' of 1000 Float elements needs more than its 8 bytes");
  EXPECT_HAS(load_error(archive("missing.pt", tensor_pickle({2}, {1}), {})), "data/0' is missing");
  EXPECT_HAS(load_error(archive("intgrad.pt", tensor_pickle({1}, {1}, 0, 1, "LongStorage", true))),
             "requires_grad on a Long tensor");
  EXPECT_HAS(load_error(archive("class.pt", tensor_pickle({1}, {1}, 0, 1, "Tensor"))),
             "global 'torch.Tensor' is not allowed");
  EXPECT_HAS(load_error(archive("dims.pt", tensor_pickle({2, 1}, {1}))),
             "a tensor with 2 sizes and 1 strides");
  EXPECT_HAS(load_error(archive("where.pt",
                                tensor_pickle({2}, {1}, 0, 2, "FloatStorage", false, "bogus"))),
             "storage '0' has the location 'bogus', which names no device");
  // A device this build may lack ("cuda:0") is a location still: loaded to the CPU (LoadOptions).
  const io::Object gpu =
      io::load(archive("gpu.pt", tensor_pickle({2}, {1}, 0, 2, "FloatStorage", false, "cuda:0")));
  EXPECT_TRUE(std::get<at::Tensor>(gpu.tree.at(tr::Path{"t"}).leaf()).device().is_cpu());
  // The same tensor pickle with a correct storage loads: the cases above fail on one field only.
  const io::Object ok = io::load(archive("ok.pt", tensor_pickle({2}, {1})));
  EXPECT_TRUE(std::get<at::Tensor>(ok.tree.at(tr::Path{"t"}).leaf()).equal(at::zeros({2})));
}

TEST_F(Malformed, LegacyFormat) {
  const std::string good = read_file(fixture("legacy.pt"));
  ASSERT_NO_THROW(io::load(write("good.pt", good)));
  for (std::size_t cut : {std::size_t{16}, good.size() / 3, good.size() - 1}) {
    SCOPED_TRACE("truncated at " + std::to_string(cut));
    EXPECT_HAS(load_error(write("cut.pt", good.substr(0, cut))), "cut.pt: at byte ");
  }
}

TEST_F(Malformed, Safetensors) {
  auto file = [&](const std::string& name, const std::string& header, const std::string& data) {
    std::string bytes(8, '\0');
    for (int k = 0; k < 8; ++k) bytes[k] = static_cast<char>((header.size() >> (8 * k)) & 0xff);
    return write(name, bytes + header + data);
  };
  const std::string f32x2 = std::string(8, '\0');
  ASSERT_NO_THROW(io::load_safetensors(
      file("ok.safetensors", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2)));
  std::string huge(8, '\xff');
  EXPECT_HAS(safetensors_error(write("huge.safetensors", huge)), "(at most 100 MB)");
  std::string longer(8, '\0');
  longer[0] = 100;
  EXPECT_HAS(safetensors_error(write("long.safetensors", longer + "{}")),
             "the input ends inside the header");
  EXPECT_HAS(safetensors_error(file("json.safetensors", "{\"a\": ", "")),
             "the header is not valid UTF-8 JSON");
  EXPECT_HAS(safetensors_error(file("utf8.safetensors", "{\"\xff\":{}}", "")),
             "the header is not valid UTF-8 JSON");
  EXPECT_HAS(
      safetensors_error(file(
          "dup.safetensors",
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          f32x2)),
      "the header names 'a' twice");
  EXPECT_HAS(
      safetensors_error(file(
          "overlap.safetensors",
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          f32x2)),
      "overlapping the tensor before it");
  EXPECT_HAS(
      safetensors_error(file("gap.safetensors",
                             R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f32x2)),
      "leaving a gap");
  EXPECT_HAS(
      safetensors_error(file("size.safetensors",
                             R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2)),
      "tensor 'a': 8 bytes in data_offsets, its dtype and shape need 12");
  EXPECT_HAS(
      safetensors_error(file("tail.safetensors",
                             R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f32x2)),
      "the tensors use 4 bytes of data, the file holds 8");
  // The float8 and unsigned dtypes PyTorch 2.x has load as those dtypes.
  for (const auto& [name, dtype] :
       {std::pair{"F8_E4M3", at::kFloat8_e4m3fn}, std::pair{"U32", at::kUInt32}}) {
    const std::string shape = std::string(name) == "U32" ? "2" : "8";
    const std::string header = std::string(R"({"a":{"dtype":")") + name + R"(","shape":[)" + shape +
                               R"(],"data_offsets":[0,8]}})";
    const auto path = file(std::string(name) + ".safetensors", header, f32x2);
    EXPECT_EQ(io::load_safetensors(path).tensors.at("a").leaf().scalar_type(), dtype) << name;
  }
  EXPECT_HAS(
      safetensors_error(file("q7.safetensors",
                             R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", f32x2)),
      "unknown dtype 'Q7'");
  EXPECT_HAS(safetensors_error(file("meta.safetensors", R"({"__metadata__":{"x":1}})", "")),
             "__metadata__ 'x' is not a string");
  EXPECT_HAS(
      safetensors_error(file("shape.safetensors",
                             R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2)),
      "a dimension is not a non-negative integer");
  EXPECT_HAS(
      safetensors_error(file(
          "overflow.safetensors",
          R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", f32x2)),
      "its byte size overflows");
  EXPECT_HAS(safetensors_error(file("fields.safetensors", R"({"a":{"dtype":"F32"}})", "")),
             "needs dtype, shape and data_offsets");
}

// PyTorch 2.x's additions, which Debian's PyTorch 1.13 cannot write: _rebuild_tensor_v3 with
// an UntypedStorage and an explicit dtype, and the byteorder record.
TEST_F(Malformed, PyTorch2AdditionsLoad) {
  std::string pickle = std::string("\x80\x02}(") + str("t") +
                       "ctorch._utils\n_rebuild_tensor_v3\n((" + str("storage") +
                       "ctorch\nUntypedStorage\n" + str("0") + str("cpu") + integer(8) + "tQ" +
                       integer(0) + ints({2}) + ints({1}) + "\x89" +
                       "ccollections\nOrderedDict\n)R" + "ctorch\nfloat32\n" + "N" + "tRu.";
  std::string data(8, '\0');
  const float values[2] = {1.5f, -2.0f};
  std::memcpy(data.data(), values, 8);
  const io::Object o =
      io::load(archive("v3.pt", pickle, {{"data/0", data}, {"byteorder", "little"}}));
  EXPECT_TRUE(
      std::get<at::Tensor>(o.tree.at(tr::Path{"t"}).leaf()).equal(at::tensor({1.5f, -2.0f})));
  // The metadata torch appends for a conjugate or negative view: the bit read, nothing else.
  auto with_metadata = [&](const std::string& name, const std::string& metadata) {
    std::string p = pickle;
    p.replace(p.rfind("NtRu."), 5, metadata + "tRu.");
    return archive(name, p, {{"data/0", data}, {"byteorder", "little"}});
  };
  const io::Object neg = io::load(with_metadata("neg.pt", "}(" + str("neg") + "\x88u"));
  const at::Tensor n = std::get<at::Tensor>(neg.tree.at(tr::Path{"t"}).leaf());
  EXPECT_TRUE(n.is_neg() && n.equal(at::tensor({-1.5f, 2.0f})));
  EXPECT_HAS(load_error(with_metadata("list.pt", "]")), "tensor metadata that is not a dict");
  EXPECT_HAS(load_error(with_metadata("key.pt", "}(" + str("bogus") + "\x88u")),
             "tensor metadata other than {'conj': bool, 'neg': bool}");
  EXPECT_HAS(load_error(with_metadata("conj.pt", "}(" + str("conj") + "\x88u")),
             "at 't': a conjugate view of a Float tensor");
}

// Found by the break-it pass: each once crashed, hung or allocated without bound.
TEST_F(Malformed, FifoIsRefusedWithoutWaiting) {
  const std::string fifo = (dir_ / "pipe.pt").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_HAS(load_error(fifo), "not a regular file");
  EXPECT_HAS(safetensors_error(fifo), "not a regular file");
}

TEST_F(Malformed, SharedReferencesCannotMultiplyWithoutBound) {
  // t0 = None; t(k+1) = (tk, tk): 40 levels would be 2^40 leaves as a tree.
  std::string dag = "\x80\x02(Nq";  // every level stays on the stack: one outer tuple takes them
  dag += '\0';
  for (int k = 0; k < 40; ++k) {
    dag += 'h';
    dag += static_cast<char>(k);
    dag += 'h';
    dag += static_cast<char>(k);
    dag += "\x86q";
    dag += static_cast<char>(k + 1);
  }
  EXPECT_HAS(load_error(archive("dag.pt", dag + "t.")), "would expand to more than");
  // A list shared by set() many times: no copies while reading.
  std::string sets = "\x80\x02(](" + std::string(2000, 'N') + "eq\x01";
  for (int k = 0; k < 2000; ++k) sets += "c__builtin__\nset\nh\x01\x85R";
  EXPECT_HAS(load_error(archive("sets.pt", sets + "t.")), "would expand to more than");
}

// The break-it pass's memory bombs: small files whose memo references (or long keys) would
// expand, as a tree, to gigabytes. Each is refused by the expansion budget (checkpoint.hpp:
// 128 bytes per pickle byte plus 64 MiB), naming the object's offset, before the memory is
// taken (so these tests need a few hundred MB at most, where the files asked for 2 to 100 GB).
struct Refusal {
  std::string what;
  std::optional<std::uint64_t> offset;
};
Refusal refusal(const std::string& path) {
  try {
    io::load(path);
  } catch (const io::IoError& e) {
    EXPECT_EQ(e.file(), path);
    return {e.what(), e.offset()};
  }
  ADD_FAILURE() << "no IoError for " << path;
  return {};
}
std::string repeat(const std::string& piece, std::size_t n) {
  std::string out;
  out.reserve(piece.size() * n);
  for (std::size_t k = 0; k < n; ++k) out += piece;
  return out;
}

TEST_F(Malformed, MemoBombsAreRefusedWithinTheBudget) {
  const std::string mib(1 << 20, 'x');
  // 1. One 1 MiB string referenced 100k times (1.2 MB asking for 100 GB): the string at byte 4.
  const std::string strings = "\x80\x02](" + str(mib) + "q\x00"s + repeat("h\x00"s, 99'999) + "e.";
  Refusal r = refusal(archive("strings.pt", strings));
  EXPECT_HAS(r.what, "the object made at byte 4 would expand to more than");
  EXPECT_EQ(r.offset, std::optional<std::uint64_t>(4));
  // 2. 999 nested lists around 100k references to one empty list (200 KB; each reference's
  //    path, 1000 keys, is recorded as a list): the empty list at byte 2 + 998 + 2.
  const std::string nested = "\x80\x02" + std::string(998, ']') + "](]q\x00"s +
                             repeat("h\x00"s, 99'999) + "e" + std::string(998, 'a') + ".";
  r = refusal(archive("nested.pt", nested));
  EXPECT_HAS(r.what, "the object made at byte 1002 would expand to more than");
  EXPECT_HAS(r.what, ". ... (999 keys)");
  // 3. One 1 MiB dict key above 2000 lists (each list's recorded path holds the key).
  const std::string keyed = "\x80\x02}" + str(mib) + "](" + std::string(2000, ']') + "es.";
  r = refusal(archive("keyed.pt", keyed));
  EXPECT_HAS(r.what, "at 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx (1048576 bytes in all).");
  EXPECT_HAS(r.what, "would expand to more than");
  ASSERT_TRUE(r.offset.has_value());
  EXPECT_GT(*r.offset, mib.size());  // one of the inner lists
  // 4. While reading: _codecs.encode of one memo'd 1 MiB string called 100k times.
  const std::string encoded = "\x80\x02(c_codecs\nencode\nq\x00"s + str(mib) + str("latin1") +
                              "\x86q\x01" + repeat("h\x00h\x01R"s, 99'999) + "t.";
  r = refusal(archive("encoded.pt", encoded));
  EXPECT_HAS(r.what, "the pickle would expand to more than");
  ASSERT_TRUE(r.offset.has_value());
  EXPECT_EQ(static_cast<unsigned char>(encoded[*r.offset]), 'R');
  // 5. While reading: a tensor's memo'd 100k-dim size and stride, re-read by 100k tensors.
  const std::string pid =
      "(" + str("storage") + "ctorch\nFloatStorage\n" + str("0") + str("cpu") + integer(2) + "tQ";
  const std::string dims = "(" + repeat("K\x01", 100'000) + "t";
  const std::string tensor = "ctorch._utils\n_rebuild_tensor_v2\nq\x00("s + pid + integer(0) +
                             dims + dims +
                             "\x89"
                             "ccollections\nOrderedDict\n)Rtq\x01R";
  const std::string sizes = "\x80\x02](" + tensor + repeat("h\x00h\x01R"s, 99'999) + "e.";
  r = refusal(archive("sizes.pt", sizes));
  EXPECT_HAS(r.what, "the pickle would expand to more than");
  ASSERT_TRUE(r.offset.has_value());
  EXPECT_EQ(static_cast<unsigned char>(sizes[*r.offset]), 'R');
}

// Where the budget stops: the same shapes, small enough, load (a shared value at many paths).
TEST_F(Malformed, SharingWithinTheBudgetLoads) {
  const std::string strings =
      "\x80\x02](" + str(std::string(1000, 'y')) + "q\x00"s + repeat("h\x00"s, 9'999) + "e.";
  const io::Object o = io::load(archive("strings.pt", strings));
  ASSERT_EQ(o.tree.size(), 10'000u);
  EXPECT_EQ(std::get<std::string>(o.tree.at(tr::Path{"9999"}).leaf()), std::string(1000, 'y'));
}

TEST_F(Malformed, OverlappingZipRecords) {
  const std::string good =
      read_file(archive("two.pt", tensor_pickle({2}, {1}),
                        {{"data/0", std::string(8, '\0')}, {"data/1", std::string(8, '\1')}}));
  std::vector<std::size_t> entries;
  for (std::size_t p = good.find(std::string("PK\x01\x02", 4)); p != std::string::npos;
       p = good.find(std::string("PK\x01\x02", 4), p + 4))
    entries.push_back(p);
  ASSERT_GE(entries.size(), 3u);
  std::string same = good;  // the last entry's local header offset := the one before it
  same.replace(entries.back() + 42, 4, good.substr(entries[entries.size() - 2] + 42, 4));
  EXPECT_HAS(load_error(write("same.pt", same)), "share their bytes");
}

TEST_F(Malformed, LegacyStorageKeysMustBeAListOfStrings) {
  const std::string magic("\x80\x02\x8a\x0al\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15);
  const std::string head = magic + "\x80\x02M\xe9\x03." + "\x80\x02}." + "\x80\x02N.";
  EXPECT_HAS(load_error(write("dict.pt", head + "\x80\x02}.")), "the storage keys are not a list");
  EXPECT_HAS(load_error(write("nested.pt", head + "\x80\x02](]e.")),
             "storage key 0 is not a string");
}

TEST_F(Malformed, WideSafetensorsHeaderIsParsedInLinearTime) {
  std::string header = "{";
  for (int k = 0; k < 160000; ++k) header += (k ? ",\"t" : "\"t") + std::to_string(k) + "\":{}";
  header += "}";
  std::string bytes(8, '\0');
  for (int k = 0; k < 8; ++k) bytes[k] = static_cast<char>((header.size() >> (8 * k)) & 0xff);
  EXPECT_HAS(safetensors_error(write("wide.safetensors", bytes + header)),
             "needs dtype, shape and data_offsets");
  std::string zero =
      R"({"z":{"dtype":"F32","shape":[0,4611686018427387904,4],"data_offsets":[0,0]}})";
  std::string zb(8, '\0');
  for (int k = 0; k < 8; ++k) zb[k] = static_cast<char>((zero.size() >> (8 * k)) & 0xff);
  EXPECT_HAS(safetensors_error(write("strides.safetensors", zb + zero)), "strides overflow int64");
}
