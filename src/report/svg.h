// Line charts as plain inline SVG: the report must open from a file with no network and no
// script, so every chart is drawn by the browser's own SVG renderer from coordinates we compute.
// Each chart and series carries data attributes (data-chart, data-series, data-points) so a test
// can count what was drawn in the rendered DOM.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardlm::report {

struct Series {
  std::string name;
  std::vector<double> x, y;  // equal lengths; non-finite points are left out when drawn
  std::string color{};
  bool dashed = false;
  bool dots = false;  // a dot per point (few points, e.g. evaluations)
  int64_t rows = -1;  // the points this series stands for when reduced (SeriesBuilder); -1: x's finite points
};

// A series built point by point that keeps a bounded number of points however many it is given,
// so a run of a million steps costs what one of a few thousand does. Consecutive points are
// grouped in buckets of `width`; a bucket keeps its lowest and its highest point (in the order
// given), so spikes and dips survive the reduction; when the buckets fill, neighbours merge and
// the width doubles. The first and the last point are always kept; while there are at most
// kMaxBuckets points, every one is.
class SeriesBuilder {
 public:
  static constexpr size_t kMaxBuckets = 1500;
  // positive_only: for a log axis, where only positive values can be drawn.
  explicit SeriesBuilder(bool positive_only = false) : positive_only_(positive_only) {}
  // A point that cannot be drawn (non-finite, or not positive on a log axis) is left out.
  void add(double x, double y);
  Series series(const std::string& name, const std::string& color, bool dashed = false, bool dots = false) const;
  int64_t rows() const { return rows_; }
  double max_y() const { return max_y_; }

 private:
  struct Point {
    int64_t index;  // its place among the points given
    double x, y;
  };
  struct Bucket {
    Point lo, hi;
    int64_t n;
  };
  void merge_neighbours();
  std::vector<Bucket> buckets_;
  Point first_{}, last_{};
  int64_t width_ = 1, rows_ = 0;
  double max_y_ = -1e300;
  bool positive_only_;
};

// A labelled point drawn on top of the lines (a skipped step, a resume).
struct Marker {
  double x;
  std::string label;
};

// A horizontal reference line (a median, a prediction).
struct Level {
  double y;
  std::string label;
  std::string color;
};

struct Chart {
  std::string id;  // unique in the page: <svg id="chart-ID" data-chart="ID">
  std::string title, x_label, y_label;
  std::vector<Series> series{};
  std::vector<Marker> markers{};
  std::vector<Level> levels{};
  bool log_y = false;
};

// One <figure> holding the chart's SVG and its legend; a chart with no finite point says so. Each
// polyline's data-points is the points it draws, data-rows the points it stands for (its `rows`,
// else the finite points it was given; more than 4000 given are thinned to every k-th and the last).
std::string render_svg(const Chart& c);
// A palette colour for series i.
std::string color(int i);
// Text made safe inside HTML elements and attribute values.
std::string escape(const std::string& s);

}  // namespace shardlm::report
