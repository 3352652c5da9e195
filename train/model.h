// The trainer's models: an MLP and a small CNN, built from the [model] config section.
//
//   mlp: 784 -> hidden[0] -> ReLU -> ... -> hidden[n-1] -> ReLU -> 10
//   cnn: for each c in conv_channels: conv kxk (conv_padding: same or valid) -> ReLU ->
//        maxpool 2x2
//        (run as maxpool then ReLU: the same function and gradient, less work),
//        then flatten -> (dense hidden[i] -> ReLU)* -> dense 10
// followed by softmax cross-entropy. Parameters and gradients are each one contiguous float
// buffer (Network::params(), Network::grads()), so a step's gradient is one all-reduce.
#pragma once

#include <cstdint>
#include <memory>

#include "train/nn.h"

namespace qring::train {

struct ModelSection;
struct Dataset;

using Model = Network<float>;

// Builds (and finalizes, but does not initialize) the network for 28x28x1 inputs, 10 classes.
// Throws ConfigError naming the key on an impossible shape.
template <class T>
std::unique_ptr<Network<T>> build_network(const ModelSection& cfg, Shape input = {1, 28, 28},
                                          int num_classes = 10);

// build_network<float> + init(seed).
std::unique_ptr<Model> make_model(const ModelSection& cfg, uint64_t seed);

// Forward passes over the whole dataset in batches of `batch`: summed loss, correct, count.
EvalResult evaluate_dataset(Model& model, const Dataset& data, int64_t batch);

extern template std::unique_ptr<Network<float>> build_network<float>(const ModelSection&, Shape,
                                                                     int);
extern template std::unique_ptr<Network<double>> build_network<double>(const ModelSection&, Shape,
                                                                       int);

}  // namespace qring::train
