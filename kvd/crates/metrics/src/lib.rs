//! OpenMetrics text for kvd's two HTTP services (`kvd serve`'s admin port and `kvd control`):
//! the content type they answer with and the encoders of constant metrics that their
//! collectors write at scrape time (prometheus-client's types). Its own crate so that neither
//! service imports the other for it.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// The content type of the OpenMetrics text both services answer `/metrics` with.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Encode one constant gauge (for collectors that read state at scrape time).
pub fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: i64) -> std::fmt::Result {
    ConstGauge::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// Encode one constant counter (`_total` is appended).
pub fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    ConstCounter::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}
