#include "train/model.h"

#include <fmt/format.h>

#include <algorithm>

#include "net/base/error.h"
#include "train/config.h"
#include "train/dataset.h"

namespace qring::train {

template <class T>
std::unique_ptr<Network<T>> build_network(const ModelSection& cfg, Shape input, int num_classes) {
  auto net = std::make_unique<Network<T>>(input, num_classes);
  if (cfg.type == "cnn") {
    Shape s = input;
    const int k = static_cast<int>(cfg.conv_kernel);
    const int pad = cfg.conv_padding == "valid" ? 0 : k / 2;
    for (int64_t ch : cfg.conv_channels) {
      // Each block: the convolution (its output is s + 2 pad - k + 1 on a side), then the
      // 2x2 pooling, which needs at least 2 x 2.
      if (s.h + 2 * pad - k + 1 < 2 || s.w + 2 * pad - k + 1 < 2) {
        throw ConfigError(fmt::format(
            "config key 'model.conv_channels': {} blocks of {}x{} convolutions ({} padding) and "
            "2x2 pooling shrink a {}x{} input below 1x1",
            cfg.conv_channels.size(), k, k, cfg.conv_padding, input.h, input.w));
      }
      net->add(std::make_unique<Conv2d<T>>(s, static_cast<int>(ch), k, pad));
      // Pooling before the ReLU computes the same function and gradient (max and ReLU
      // commute), with the ReLU on a quarter of the values.
      net->add(std::make_unique<MaxPool2<T>>(net->current_shape()));
      s = net->current_shape();
      net->add(std::make_unique<Relu<T>>(s, true));
    }
    net->add(std::make_unique<Flatten<T>>(s));
  } else if (cfg.type != "mlp") {
    throw ConfigError(fmt::format("config key 'model.type': unknown value '{}'", cfg.type));
  }
  for (int64_t h : cfg.hidden) {
    net->add(std::make_unique<Dense<T>>(net->current_shape().size(), h));
    net->add(std::make_unique<Relu<T>>(net->current_shape(), false));
  }
  net->add(std::make_unique<Dense<T>>(net->current_shape().size(), num_classes));
  net->finalize();
  return net;
}

std::unique_ptr<Model> make_model(const ModelSection& cfg, uint64_t seed) {
  auto m = build_network<float>(cfg);
  m->init(seed);
  return m;
}

EvalResult evaluate_dataset(Model& model, const Dataset& data, int64_t batch) {
  if (batch < 1) throw UsageError(fmt::format("evaluate_dataset: batch {} < 1", batch));
  EvalResult total;
  for (int64_t start = 0; start < data.size(); start += batch) {
    const int n = static_cast<int>(std::min(batch, data.size() - start));
    EvalResult r = model.evaluate(data.image(start), data.labels.data() + start, n);
    total.loss_sum += r.loss_sum;
    total.correct += r.correct;
    total.count += r.count;
  }
  return total;
}

template std::unique_ptr<Network<float>> build_network<float>(const ModelSection&, Shape, int);
template std::unique_ptr<Network<double>> build_network<double>(const ModelSection&, Shape, int);

}  // namespace qring::train
