// Line charts as plain inline SVG: the report must open from a file with no network and no
// script, so every chart is drawn by the browser's own SVG renderer from coordinates we compute.
// Each chart and series carries data attributes (data-chart, data-series, data-points) so a test
// can count what was drawn in the rendered DOM.
#pragma once

#include <string>
#include <vector>

namespace shardlm::report {

struct Series {
  std::string name;
  std::vector<double> x, y;  // equal lengths; non-finite points are left out when drawn
  std::string color{};
  bool dashed = false;
  bool dots = false;  // a dot per point (few points, e.g. evaluations)
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
// polyline's data-points is the points it draws, data-rows the finite points it was given (more
// than 4000 are thinned to every k-th and the last).
std::string render_svg(const Chart& c);
// A palette colour for series i.
std::string color(int i);
// Text made safe inside HTML elements and attribute values.
std::string escape(const std::string& s);

}  // namespace shardlm::report
