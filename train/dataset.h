// In-memory datasets, normalization, per-rank sharding and minibatches.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "net/base/large_buffer.h"
#include "train/nn.h"

namespace qring::train {

struct DataSection;

// Datasets: hundreds of MB written once at load, in huge pages (net/base/large_buffer.h); resize()
// leaves new elements unset, the loaders write every one.
template <class T>
using DataVector = std::vector<T, net::LargeAllocator<T, /*DefaultInit=*/true>>;

// N images of `dim` floats each (sample-contiguous: image i is images[i*dim, (i+1)*dim)),
// pixels in row-major 28x28 order, and N labels in 0..num_classes-1.
struct Dataset {
  int64_t dim = 784;
  int num_classes = 10;
  DataVector<float> images;  // 64-byte aligned: see nn.h
  std::vector<int32_t> labels;

  int64_t size() const { return static_cast<int64_t>(labels.size()); }
  const float* image(int64_t i) const { return images.data() + i * dim; }
};

struct DatasetPair {
  Dataset train;
  Dataset test;
  // What the ranks compare to know they train on the same data: a 64-bit digest of the four
  // IDX files' dimensions and contents (0 for synthetic data, which the configuration fixes).
  uint64_t digest = 0;
  // Normalization applied to both: x = (pixel / 255 - mean) / std, mean and std over every
  // pixel of the training set (so all ranks, which load the whole set, agree bit for bit).
  double mean = 0.0;
  double std = 1.0;
};

// How much memory the datasets may take (issue 44, N5): data.max_bytes, and the memory
// available on this host shared by its ranks, whichever is less.
struct MemoryBudget {
  uint64_t bytes = UINT64_MAX;
  std::string source = "no limit";  // names the limit in errors
};
// data.max_bytes (0: none) and MemAvailable (/proc/meminfo) / local_ranks.
MemoryBudget data_budget(const DataSection& cfg, int local_ranks);

// Reads <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (also without .gz), checks image
// and label counts agree, and normalizes. All four headers are read and checked first --
// counts against each other, and the memory they imply (images as floats, labels) against
// `budget` -- before anything is allocated. Throws DataError naming the file on any problem.
DatasetPair load_fashion_mnist(const std::string& dir, const MemoryBudget& budget = {});

// Deterministic learnable data: 10 smooth class prototypes (7x7 noise upsampled to 28x28), each
// sample a prototype times a random contrast plus pixel noise; labels balanced round-robin then
// shuffled. Already roughly zero-mean, unit-variance.
DatasetPair make_synthetic(int64_t n_train, int64_t n_test, uint64_t seed);

// data.dataset = fashion-mnist | synthetic, with data.path / data.synthetic_* and the seed,
// within data_budget(cfg, local_ranks) (synthetic data too: ConfigError naming the keys).
DatasetPair load_datasets(const DataSection& cfg, uint64_t seed, int local_ranks = 1);

// Where a rank is in its stream of minibatches: `index` batches of epoch `epoch` are done.
struct DataPosition {
  int64_t epoch = 0;
  int64_t index = 0;
  bool operator==(const DataPosition&) const = default;
};

// Every epoch, the whole dataset is permuted by a shuffle seeded from (seed, epoch) — the same
// permutation on every rank — and rank r of W takes the slice [r*S, (r+1)*S) with
// S = floor(N / W). The slice is cut into floor(S / batch) full batches; the remainder of the
// dataset and of the slice is skipped that epoch (a different remainder each epoch). All ranks
// therefore do the same number of steps per epoch.
class Sharder {
 public:
  Sharder(int64_t dataset_size, int rank, int world, int64_t batch, uint64_t seed);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t batch_size() const { return batch_; }
  DataPosition position() const { return pos_; }
  void seek(DataPosition pos);  // throws UsageError if pos.index >= batches_per_epoch()

  // The dataset indices of the next batch; advances the position (to the next epoch after
  // the last batch). The reference is valid until the next call.
  const std::vector<int32_t>& next_batch();

  // The permutation of [0, N) used for an epoch (exposed for tests).
  std::vector<int32_t> epoch_permutation(int64_t epoch) const;

 private:
  int64_t n_;
  int rank_;
  int world_;
  int64_t batch_;
  uint64_t seed_;
  int64_t shard_;
  int64_t batches_per_epoch_;
  DataPosition pos_;
  int64_t perm_epoch_ = -1;
  std::vector<int32_t> perm_;
  std::vector<int32_t> out_;
};

// Copies the samples `idx` into x (idx.size() * dim floats, sample-contiguous) and y.
void gather_batch(const Dataset& d, const std::vector<int32_t>& idx, float* x, int32_t* y);

}  // namespace qring::train
