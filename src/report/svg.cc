#include "report/svg.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <limits>

namespace shardlm::report {

namespace {

constexpr double kW = 640, kH = 260, kLeft = 70, kRight = 14, kTop = 14, kBottom = 40;

bool usable(const Chart& c, double x, double y) {
  return std::isfinite(x) && std::isfinite(y) && (!c.log_y || y > 0);
}

double y_value(const Chart& c, double y) { return c.log_y ? std::log10(y) : y; }

struct Range {
  double lo = std::numeric_limits<double>::infinity(), hi = -std::numeric_limits<double>::infinity();
  void add(double v) { lo = std::min(lo, v), hi = std::max(hi, v); }
  bool empty() const { return lo > hi; }
  // A flat range still needs a height to map into.
  void widen() {
    if (hi - lo < 1e-12 * std::max(1.0, std::abs(hi))) lo -= 0.5 * std::max(1.0, std::abs(lo)) * 0.1, hi += 0.5 * std::max(1.0, std::abs(hi)) * 0.1;
  }
};

// A short label for an axis value: engineering-ish, so ticks of 1e9 bytes or 3e-4 lr stay narrow.
std::string tick_label(double v) {
  const double a = std::abs(v);
  if (a == 0) return "0";
  if (a >= 1e9) return fmt::format("{:.3g}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:.3g}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:.3g}k", v / 1e3);
  return fmt::format("{:.3g}", v);
}

// About n round tick values across [lo, hi].
std::vector<double> ticks(double lo, double hi, int n) {
  const double raw = (hi - lo) / n;
  const double mag = std::pow(10, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> out;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push_back(std::abs(t) < step * 1e-9 ? 0 : t);
  return out;
}

struct Frame {
  Range x, y;
  double px(double v) const { return kLeft + (v - x.lo) / (x.hi - x.lo) * (kW - kLeft - kRight); }
  double py(double v) const { return kH - kBottom - (v - y.lo) / (y.hi - y.lo) * (kH - kTop - kBottom); }
};

Frame frame_of(const Chart& c) {
  Frame f;
  for (const Series& s : c.series)
    for (size_t i = 0; i < s.x.size(); ++i)
      if (usable(c, s.x[i], s.y[i])) f.x.add(s.x[i]), f.y.add(y_value(c, s.y[i]));
  for (const Level& l : c.levels)
    if (usable(c, 0, l.y)) f.y.add(y_value(c, l.y));
  for (const Marker& m : c.markers)
    if (std::isfinite(m.x)) f.x.add(m.x);
  return f;
}

std::string axes(const Chart& c, const Frame& f) {
  std::string out = fmt::format(R"(<rect x="{}" y="{}" width="{}" height="{}" class="plot"/>)", kLeft, kTop,
                                kW - kLeft - kRight, kH - kTop - kBottom);
  for (double t : ticks(f.x.lo, f.x.hi, 6))
    out += fmt::format(R"(<text x="{:.1f}" y="{}" class="tick" text-anchor="middle">{}</text>)", f.px(t), kH - kBottom + 14,
                       tick_label(t));
  for (double t : ticks(f.y.lo, f.y.hi, 5)) {
    const double v = c.log_y ? std::pow(10, t) : t;
    out += fmt::format(R"(<line x1="{}" x2="{}" y1="{:.1f}" y2="{:.1f}" class="grid"/>)", kLeft, kW - kRight, f.py(t), f.py(t));
    out += fmt::format(R"(<text x="{}" y="{:.1f}" class="tick" text-anchor="end">{}</text>)", kLeft - 4, f.py(t) + 4,
                       tick_label(v));
  }
  out += fmt::format(R"(<text x="{}" y="{}" class="label" text-anchor="middle">{}</text>)", (kLeft + kW - kRight) / 2,
                     kH - 6, escape(c.x_label));
  out += fmt::format(R"x(<text x="14" y="{}" class="label" text-anchor="middle" transform="rotate(-90 14 {})">{}</text>)x",
                     (kTop + kH - kBottom) / 2, (kTop + kH - kBottom) / 2, escape(c.y_label + (c.log_y ? " (log)" : "")));
  return out;
}

// A long run's series is thinned to about kMaxDrawn points (every k-th, and the last), so the page
// stays small enough to open; data-rows keeps how many there were.
constexpr size_t kMaxDrawn = 4000;

std::string polyline(const Chart& c, const Frame& f, const Series& s) {
  std::vector<size_t> keep;
  for (size_t i = 0; i < s.x.size(); ++i)
    if (usable(c, s.x[i], s.y[i])) keep.push_back(i);
  const size_t stride = (keep.size() + kMaxDrawn - 1) / kMaxDrawn;
  std::string pts;
  std::string dots;
  int n = 0;
  for (size_t k = 0; k < keep.size(); ++k) {
    if (stride > 1 && k % stride != 0 && k + 1 != keep.size()) continue;
    const size_t i = keep[k];
    ++n;
    const double x = f.px(s.x[i]), y = f.py(y_value(c, s.y[i]));
    pts += fmt::format("{}{:.1f},{:.1f}", pts.empty() ? "" : " ", x, y);
    if (s.dots) dots += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="3" fill="{}"/>)", x, y, s.color);
  }
  return fmt::format(R"(<polyline data-series="{}" data-points="{}" data-rows="{}" points="{}" fill="none" stroke="{}" stroke-width="1.5"{}/>)",
                     escape(s.name), n, s.rows >= 0 ? static_cast<size_t>(s.rows) : keep.size(), pts, s.color, s.dashed ? R"( stroke-dasharray="5 3")" : "") +
         dots;
}

std::string overlays(const Chart& c, const Frame& f) {
  std::string out;
  for (const Level& l : c.levels) {
    if (!usable(c, 0, l.y)) continue;
    const double y = f.py(y_value(c, l.y));
    out += fmt::format(R"(<line data-level="{}" x1="{}" x2="{}" y1="{:.1f}" y2="{:.1f}" stroke="{}" stroke-dasharray="2 3"/>)",
                       escape(l.label), kLeft, kW - kRight, y, y, l.color);
  }
  out += fmt::format(R"(<g data-markers="{}">)", c.markers.size());
  for (const Marker& m : c.markers)
    out += fmt::format(R"(<line x1="{:.1f}" x2="{:.1f}" y1="{}" y2="{}" class="marker"><title>{}</title></line>)", f.px(m.x),
                       f.px(m.x), kTop, kH - kBottom, escape(m.label));
  return out + "</g>";
}

std::string legend(const Chart& c) {
  std::string out = R"(<figcaption>)" + escape(c.title);
  for (const Series& s : c.series)
    out += fmt::format(R"( <span class="key"><i style="background:{}"></i>{}</span>)", s.color, escape(s.name));
  for (const Level& l : c.levels) out += fmt::format(R"( <span class="key level" style="color:{}">┄ {}</span>)", l.color, escape(l.label));
  if (!c.markers.empty()) out += R"( <span class="key marked">│ )" + std::to_string(c.markers.size()) + " marked</span>";
  return out + "</figcaption>";
}

}  // namespace

void SeriesBuilder::add(double x, double y) {
  if (!std::isfinite(x) || !std::isfinite(y) || (positive_only_ && y <= 0)) return;
  const Point p{rows_++, x, y};
  if (p.index == 0) first_ = p;
  last_ = p;
  max_y_ = std::max(max_y_, y);
  if (buckets_.empty() || buckets_.back().n == width_) {
    buckets_.push_back({p, p, 1});
    if (buckets_.size() > kMaxBuckets) merge_neighbours();
    return;
  }
  Bucket& b = buckets_.back();
  if (y < b.lo.y) b.lo = p;
  if (y > b.hi.y) b.hi = p;
  ++b.n;
}

// Pairs of full buckets become one of twice the width; an odd last one stays and fills on.
void SeriesBuilder::merge_neighbours() {
  std::vector<Bucket> merged;
  merged.reserve(buckets_.size() / 2 + 1);
  for (size_t i = 0; i + 1 < buckets_.size(); i += 2) {
    const Bucket &a = buckets_[i], &b = buckets_[i + 1];
    merged.push_back({b.lo.y < a.lo.y ? b.lo : a.lo, b.hi.y > a.hi.y ? b.hi : a.hi, a.n + b.n});
  }
  if (buckets_.size() % 2) merged.push_back(buckets_.back());
  buckets_ = std::move(merged);
  width_ *= 2;
}

Series SeriesBuilder::series(const std::string& name, const std::string& color, bool dashed, bool dots) const {
  std::vector<Point> points;
  auto keep = [&](const Point& p) {
    if (points.empty() || points.back().index < p.index) points.push_back(p);
  };
  if (rows_ > 0) keep(first_);
  for (const Bucket& b : buckets_) {
    const bool lo_first = b.lo.index <= b.hi.index;
    keep(lo_first ? b.lo : b.hi);
    keep(lo_first ? b.hi : b.lo);
  }
  if (rows_ > 0) keep(last_);
  Series s{name, {}, {}, color, dashed, dots, rows_};
  for (const Point& p : points) s.x.push_back(p.x), s.y.push_back(p.y);
  return s;
}

std::string color(int i) {
  static const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  return kPalette[i % 10];
}

std::string escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

std::string render_svg(const Chart& c) {
  Frame f = frame_of(c);
  std::string out = fmt::format(R"(<figure class="chart">{})", legend(c));
  if (f.x.empty() || f.y.empty())
    return out + fmt::format(R"(<p class="empty" data-chart="{}" data-empty="1">no data to draw</p></figure>)", escape(c.id));
  f.x.widen(), f.y.widen();
  out += fmt::format(R"(<svg id="chart-{}" data-chart="{}" viewBox="0 0 {} {}" width="{}" height="{}" role="img">)",
                     escape(c.id), escape(c.id), kW, kH, kW, kH);
  out += axes(c, f);
  for (const Series& s : c.series) out += polyline(c, f, s);
  return out + overlays(c, f) + "</svg></figure>";
}

}  // namespace shardlm::report
