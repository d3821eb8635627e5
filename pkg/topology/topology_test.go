package topology_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/topology"
)

func TestDefaultIsValid(t *testing.T) {
	d := topology.Default()
	if err := d.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range d.Consumers {
		if len(c.QueueName()) > 80 || len(c.DLQName()) > 80 || !strings.HasSuffix(c.DLQName(), ".fifo") {
			t.Errorf("%s: queue names %q/%q break SQS FIFO naming", c.Name, c.QueueName(), c.DLQName())
		}
	}
}

func TestValidateNamesTheField(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*topology.Topology)
		want   string
	}{
		{"topic without .fifo", func(t *topology.Topology) { t.Topic.Name = "events" }, "topic.name"},
		{"bad scope", func(t *topology.Topology) { t.Topic.ThroughputScope = "Account" }, "topic.throughput_scope"},
		{"no consumers", func(t *topology.Topology) { t.Consumers = nil }, "consumers"},
		{"bad consumer name", func(t *topology.Topology) { t.Consumers[0].Name = "orders projection" }, "consumers[0].name"},
		{"duplicate consumer", func(t *topology.Topology) { t.Consumers[1].Name = t.Consumers[0].Name }, "duplicate"},
		{"visibility below 6x", func(t *topology.Topology) {
			t.Consumers[0].VisibilityTimeoutSeconds = 5 * t.Consumers[0].FunctionTimeoutSeconds
		}, "visibility_timeout_seconds"},
		{"max receive", func(t *topology.Topology) { t.Consumers[2].MaxReceiveCount = 1001 }, "consumers[2].max_receive_count"},
		{"max retries", func(t *topology.Topology) { t.Consumers[1].MaxRetries = 51 }, "consumers[1].max_retries"},
		{"max receive not above max retries", func(t *topology.Topology) {
			t.Consumers[0].MaxRetries, t.Consumers[0].MaxReceiveCount = 5, 5
		}, "consumers[0].max_receive_count 5: must exceed max_retries (5)"},
		{"concurrency", func(t *topology.Topology) { t.Consumers[0].MaxConcurrency = 1 }, "max_concurrency"},
		{"unknown filter attribute", func(t *topology.Topology) { t.Consumers[0].Filter = map[string][]string{"payload": {"x"}} }, `filter["payload"]`},
		{"empty filter values", func(t *topology.Topology) { t.Consumers[0].Filter = map[string][]string{"event_type": {}} }, "needs at least one value"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			topo := topology.Default()
			tt.mutate(&topo)
			err := topo.Validate()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one naming %s", err, tt.want)
			}
		})
	}
}

// Matches must agree with the SNS filter policy it renders: the local
// pipeline's expectations and the cloud subscriptions come from one place.
func TestFilterPolicyAndMatches(t *testing.T) {
	c := topology.Consumer{Name: "c", Filter: map[string][]string{"event_type": {"order.paid", "order.refunded"}, "tenant_id": {"acme"}}}
	var policy map[string][]string
	if err := json.Unmarshal([]byte(c.FilterPolicy()), &policy); err != nil || len(policy) != 2 || len(policy["event_type"]) != 2 {
		t.Fatalf("policy %s: %v", c.FilterPolicy(), err)
	}
	tests := []struct {
		attrs map[string]string
		want  bool
	}{
		{map[string]string{"event_type": "order.paid", "tenant_id": "acme"}, true},
		{map[string]string{"event_type": "order.refunded", "tenant_id": "acme", "aggregate_type": "order"}, true},
		{map[string]string{"event_type": "order.created", "tenant_id": "acme"}, false},
		{map[string]string{"event_type": "order.paid", "tenant_id": "other"}, false},
		{map[string]string{"event_type": "order.paid"}, false}, // a missing attribute never matches
	}
	for _, tt := range tests {
		if got := c.Matches(tt.attrs); got != tt.want {
			t.Errorf("Matches(%v) = %v, want %v", tt.attrs, got, tt.want)
		}
	}
	all := topology.Consumer{Name: "audit"}
	if all.FilterPolicy() != "" || !all.Matches(map[string]string{}) {
		t.Fatal("a consumer without a filter must take every event and render no policy")
	}
}

// The inbox keeps rows longer than any DLQ keeps a message: one rule for
// the CDK schedule, the redrive function and the CLI.
func TestInboxRetentionOutlastsTheDLQs(t *testing.T) {
	if inbox.MinRetention <= topology.DLQRetention || inbox.DefaultRetention < inbox.MinRetention {
		t.Fatalf("inbox retention min %s / default %s must outlast the DLQs' %s", inbox.MinRetention, inbox.DefaultRetention, topology.DLQRetention)
	}
	if topology.DLQRetention != 1209600*time.Second {
		t.Fatalf("DLQ retention %s, want SQS's maximum of 14 days", topology.DLQRetention)
	}
}

// The retry budget (MaxRetries, the event's own failures) and the SQS
// redrive backstop (MaxReceiveCount) are separate, with defaults far apart;
// a topology that sets only a small maxReceiveCount keeps its old budget.
func TestRetryBudgetAndBackstop(t *testing.T) {
	for _, tt := range []struct {
		c                topology.Consumer
		retries, receive int
	}{
		{topology.Consumer{}, topology.DefaultMaxRetries, topology.DefaultMaxReceiveCount},
		{topology.Consumer{MaxRetries: 10}, 10, topology.DefaultMaxReceiveCount},
		{topology.Consumer{MaxReceiveCount: 2}, 1, 2},
		{topology.Consumer{MaxReceiveCount: 1}, 0, 1},
		{topology.Consumer{MaxRetries: 2, MaxReceiveCount: 30}, 2, 30},
	} {
		if r, n := tt.c.Retries(), tt.c.ReceiveLimit(); r != tt.retries || n != tt.receive {
			t.Errorf("%+v: retries %d, receive limit %d; want %d and %d", tt.c, r, n, tt.retries, tt.receive)
		}
	}
	for _, c := range topology.Default().Consumers {
		if c.Retries() != 4 || c.ReceiveLimit() != 100 {
			t.Errorf("default consumer %s: %d retries, maxReceiveCount %d; want 4 and 100", c.Name, c.Retries(), c.ReceiveLimit())
		}
	}
}
