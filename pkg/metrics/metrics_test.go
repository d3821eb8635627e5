package metrics_test

import (
	"bufio"
	"bytes"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/outbox"
)

func lines(t *testing.T, b *bytes.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	sc := bufio.NewScanner(b)
	for sc.Scan() {
		m, err := metrics.Validate(sc.Bytes())
		if err != nil {
			t.Fatalf("invalid EMF line %s: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	return out
}

func TestDispatcherAndConsumerLinesAreValidEMF(t *testing.T) {
	var buf bytes.Buffer
	em := metrics.New(&buf, "")
	em.Now = func() time.Time { return time.UnixMilli(1_790_000_000_000) }
	if err := em.DispatcherBacklog(outbox.Backlog{Pending: 12, Dead: 1, ParkedAggregates: 1, OldestPendingAge: 1500 * time.Millisecond,
		OldestTransactionAge: 90 * time.Second}); err != nil {
		t.Fatal(err)
	}
	var c metrics.BatchCounter
	if err := c.Flush(em); err != nil { // nothing counted: no line
		t.Fatal(err)
	}
	c.Add(outbox.BatchResult{Claimed: 5, Sent: 4, Retried: 1, PublishDuration: 12 * time.Millisecond})
	c.Add(outbox.BatchResult{Claimed: 2, Sent: 1, Dead: 1, PublishDuration: 3 * time.Millisecond})
	if err := c.Flush(em); err != nil {
		t.Fatal(err)
	}
	if err := em.InboxBatch(inbox.BatchMetrics{Consumer: "orders-projection", Records: 5, Processed: 3, Duplicates: 1,
		Failures: map[string]int{"transient": 1}, MaxLag: 2 * time.Second}); err != nil {
		t.Fatal(err)
	}
	got := lines(t, &buf)
	if len(got) != 3 {
		t.Fatalf("%d lines, want 3", len(got))
	}
	want := []map[string]any{
		{"Service": "dispatcher", "OutboxBacklog": 12.0, "OldestPendingAgeSeconds": 1.5, "DeadEvents": 1.0, "ParkedAggregates": 1.0,
			"OldestTransactionAgeSeconds": 90.0},
		{"Service": "dispatcher", "Published": 5.0, "Retries": 1.0, "Dead": 1.0},
		{"Consumer": "orders-projection", "Processed": 3.0, "Duplicates": 1.0, "Failures": 1.0, "ConsumerLagSeconds": 2.0},
	}
	for i, w := range want {
		for k, v := range w {
			if got[i][k] != v {
				t.Errorf("line %d: %s = %v, want %v", i, k, got[i][k], v)
			}
		}
		aws := got[i]["_aws"].(map[string]any)
		if aws["Timestamp"].(float64) != 1_790_000_000_000 {
			t.Errorf("line %d: timestamp %v", i, aws["Timestamp"])
		}
		d := aws["CloudWatchMetrics"].([]any)[0].(map[string]any)
		if d["Namespace"] != "Fifobox" {
			t.Errorf("namespace %v", d["Namespace"])
		}
	}
	lat := got[1]["PublishLatencyMs"].([]any)
	if len(lat) != 2 || lat[0].(float64) != 12 || lat[1].(float64) != 3 {
		t.Errorf("PublishLatencyMs %v", lat)
	}
}

func TestNamespaceFromEnvAndBadValues(t *testing.T) {
	t.Setenv("FIFOBOX_METRICS_NAMESPACE", "Shop/Outbox")
	if ns := metrics.FromEnv().Namespace(); ns != "Shop/Outbox" {
		t.Fatalf("namespace %q", ns)
	}
	var buf bytes.Buffer
	em := metrics.New(&buf, "X")
	// NaN is dropped, the rest still forms a valid line.
	if err := em.Emit(map[string]string{"Service": "s"}, metrics.Metric{Name: "A", Unit: metrics.Count, Value: math.NaN()},
		metrics.Metric{Name: "B", Unit: metrics.Count, Value: 2}); err != nil {
		t.Fatal(err)
	}
	got := lines(t, &buf)
	if len(got) != 1 || got[0]["A"] != nil || got[0]["B"] != 2.0 {
		t.Fatalf("got %v", got)
	}
	if err := em.Emit(map[string]string{"Service": "s"}, metrics.Metric{Name: "Service", Value: 1}); err == nil {
		t.Fatal("metric named like a dimension accepted")
	}
}

func TestValidateRejectsMalformedLines(t *testing.T) {
	bad := []string{
		`{"Published":1}`,
		`{"_aws":{"Timestamp":1,"CloudWatchMetrics":[]}}`,
		`{"_aws":{"Timestamp":1,"CloudWatchMetrics":[{"Namespace":"N","Dimensions":[["Service"]],"Metrics":[{"Name":"P"}]}]},"Service":"d"}`,
		`{"_aws":{"Timestamp":1,"CloudWatchMetrics":[{"Namespace":"N","Dimensions":[["Service"]],"Metrics":[{"Name":"P"}]}]},"P":"1","Service":"d"}`,
		`{"_aws":{"Timestamp":1,"CloudWatchMetrics":[{"Namespace":"N","Dimensions":[["Service"]],"Metrics":[{"Name":"P"}]}]},"P":1}`,
		`{"_aws":{"Timestamp":"now","CloudWatchMetrics":[{"Namespace":"N","Dimensions":[],"Metrics":[{"Name":"P"}]}]},"P":1}`,
	}
	for _, l := range bad {
		if _, err := metrics.Validate([]byte(l)); err == nil {
			t.Errorf("accepted %s", l)
		}
	}
	if strings.Contains(bad[0], "_aws") {
		t.Fatal("unreachable")
	}
}
