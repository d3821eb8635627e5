package metrics_test

import (
	"os"
	"regexp"
	"testing"

	"github.com/fifobox/fifobox/pkg/metrics"
)

// The CDK app (infra/, its own module) repeats the metric names its alarms
// watch, to keep the application's dependencies out of that module. This
// test keeps the two in step: an alarm on a renamed metric would never fire.
func TestInfraUsesTheEmittedMetricNames(t *testing.T) {
	src, err := os.ReadFile("../../infra/stacks/config.go")
	if err != nil {
		t.Skipf("infra module not present: %v", err)
	}
	// The long-transaction alarm's metric is declared beside its alarm.
	alarms, err := os.ReadFile("../../infra/stacks/alarms_stateful.go")
	if err != nil {
		t.Fatalf("infra/stacks/alarms_stateful.go: %v", err)
	}
	if m := regexp.MustCompile(`MetricOldestTransactionAgeSeconds\s*=\s*"([^"]*)"`).FindSubmatch(alarms); m == nil || string(m[1]) != metrics.MetricOldestTransactionAgeSeconds {
		t.Errorf("infra's MetricOldestTransactionAgeSeconds = %q, but the dispatcher emits %q", m, metrics.MetricOldestTransactionAgeSeconds)
	}
	ours := map[string]string{
		"MetricsNamespace": metrics.DefaultNamespace, "DimService": metrics.DimService, "DimConsumer": metrics.DimConsumer,
		"ServiceDispatcher":   metrics.ServiceDispatcher,
		"MetricOutboxBacklog": metrics.MetricOutboxBacklog, "MetricOldestPendingAgeSeconds": metrics.MetricOldestPendingAgeSeconds,
		"MetricDeadEvents": metrics.MetricDeadEvents, "MetricParkedAggregates": metrics.MetricParkedAggregates,
		"MetricDueEvents": metrics.MetricDueEvents, "MetricBackingOffEvents": metrics.MetricBackingOffEvents,
		"MetricParkedEvents": metrics.MetricParkedEvents, "MetricOldestDueAgeSeconds": metrics.MetricOldestDueAgeSecond,
		"MetricRetryingAggregates": metrics.MetricRetryingAggregates, "MetricStrandedEvents": metrics.MetricStrandedEvents,
		"MetricPublished": metrics.MetricPublished, "MetricRetries": metrics.MetricRetries, "MetricDead": metrics.MetricDead,
		"MetricPublishLatencyMs": metrics.MetricPublishLatencyMs, "MetricProcessed": metrics.MetricProcessed,
		"MetricDuplicates": metrics.MetricDuplicates, "MetricFailures": metrics.MetricFailures,
		"MetricConsumerLagSeconds": metrics.MetricConsumerLagSeconds,
	}
	re := regexp.MustCompile(`(?m)^\s*((?:Metric|Dim|Service)\w*)\s*=\s*"([^"]*)"`)
	found := 0
	for _, m := range re.FindAllStringSubmatch(string(src), -1) {
		want, ok := ours[m[1]]
		if !ok {
			t.Errorf("infra constant %s = %q has no counterpart in pkg/metrics", m[1], m[2])
			continue
		}
		found++
		if m[2] != want {
			t.Errorf("infra %s = %q, but the functions emit %q", m[1], m[2], want)
		}
	}
	if found < 10 {
		t.Fatalf("found only %d metric constants in infra/stacks/config.go; has the file moved?", found)
	}
}
