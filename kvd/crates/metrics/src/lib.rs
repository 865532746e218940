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

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::collector::Collector;
    use prometheus_client::registry::Registry;

    /// A collector that reads its values at scrape time, as the services' collectors do.
    #[derive(Debug)]
    struct AtScrape;

    impl Collector for AtScrape {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
            gauge(&mut e, "kvd_pool_free_pages", "Pages free", -3)?;
            counter(&mut e, "kvd_lookups", "Keys looked up", 7)
        }
    }

    #[test]
    fn a_gauge_and_a_counter_encode_as_openmetrics_text_with_their_help_and_type() {
        let mut r = Registry::default();
        r.register_collector(Box::new(AtScrape));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        for line in [
            "# HELP kvd_pool_free_pages Pages free",
            "# TYPE kvd_pool_free_pages gauge",
            "kvd_pool_free_pages -3",
            "# HELP kvd_lookups Keys looked up",
            "# TYPE kvd_lookups counter",
            "kvd_lookups_total 7",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} in:\n{text}");
        }
        assert!(CONTENT_TYPE.starts_with("application/openmetrics-text"));
    }
}
