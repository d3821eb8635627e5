package amqp

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
)

func TestHeadersLeaveOutEmptyOptionalValues(t *testing.T) {
	topo := Holdco()
	if err := topo.Prepare(); err != nil {
		t.Fatal(err)
	}
	h := topo.headersFor(&outbox.Message{EventID: "e", EventType: "paid", AggregateType: "invoice", GroupID: "i", Attributes: map[string]string{}})
	if _, ok := h["x-tenant-id"]; ok {
		t.Errorf("empty tenant header set: %v", h)
	}
	if h["x-attempts"] != int32(0) || h["x-event-id"] != "e" || h["x-aggregate-id"] != "i" {
		t.Errorf("headers %v", h)
	}
}

func TestPrepareRejects(t *testing.T) {
	base := func() Topology { return Ticketing() }
	tests := []struct {
		name   string
		mutate func(*Topology)
		field  string
	}{
		{"exchange name", func(t *Topology) { t.Exchange.Name = "amq.topic" }, "exchange.name"},
		{"exchange kind", func(t *Topology) { t.Exchange.Kind = "x-consistent-hash" }, "exchange.kind"},
		{"missing routing key", func(t *Topology) { t.RoutingKey = "" }, "routing_key"},
		{"bad routing key field", func(t *Topology) { t.RoutingKey = "{type}" }, "routing_key"},
		{"reserved header", func(t *Topology) { t.Headers["x-fifobox-error-class"] = "{event_id}" }, "headers"},
		{"queue type", func(t *Topology) { t.QueueType = "stream" }, "queue_type"},
		{"no consumers", func(t *Topology) { t.Consumers = nil }, "consumers"},
		{"duplicate consumer", func(t *Topology) { t.Consumers[1].Name = t.Consumers[0].Name }, "duplicate"},
		{"shared queue", func(t *Topology) { t.Consumers[1].Queue = t.Consumers[0].Queue }, "two consumers"},
		{"no bindings", func(t *Topology) { t.Consumers[0].Bindings = nil }, "consumers[0].bindings"},
		{"retry", func(t *Topology) { t.Consumers[0].Retry.Multiplier = 0.5 }, "consumers[0].retry"},
		{"delivery limit on classic", func(t *Topology) { t.QueueType = QueueClassic; t.Consumers[0].DeliveryLimit = 5 }, "delivery_limit"},
		{"dlx same as exchange", func(t *Topology) { t.DeadLetterExchange = t.Exchange.Name }, "dead_letter_exchange"},
	}
	for _, tt := range tests {
		topo := base()
		tt.mutate(&topo)
		err := topo.Prepare()
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("%s: %v, want an error naming %s", tt.name, err, tt.field)
		}
	}
	fan := Corewrite()
	fan.Consumers[0].Bindings = []Binding{{Key: "x"}}
	if err := fan.Prepare(); err == nil {
		t.Error("fanout with bindings accepted")
	}
	for _, tp := range []Topology{Holdco(), Ticketing(), Corewrite(), FromTopology(topology.Default())} {
		if err := tp.Prepare(); err != nil {
			t.Errorf("%s: %v", tp.Exchange.Name, err)
		}
	}
}

func TestRetryQueuesAreNamedByDelay(t *testing.T) {
	c := Consumer{Name: "inventory", Queue: "ticketing.inventory", Retry: transport.RetryPolicy{MaxRetries: 5,
		InitialDelay: transport.Duration(500 * time.Millisecond), Multiplier: 2, MaxDelay: transport.Duration(2 * time.Second)}}
	var names []string
	for _, q := range c.RetryQueues() {
		names = append(names, q.Name)
	}
	want := "ticketing.inventory.retry.500ms,ticketing.inventory.retry.1s,ticketing.inventory.retry.2s"
	if strings.Join(names, ",") != want {
		t.Errorf("retry queues %v, want %s (retries 3-5 share the capped delay's queue)", names, want)
	}
	if c.RetryQueueName(5) != "ticketing.inventory.retry.2s" || c.DLQName() != "ticketing.inventory.dlq" {
		t.Errorf("names %s %s", c.RetryQueueName(5), c.DLQName())
	}
}

func TestFromTopologyMapsFilters(t *testing.T) {
	tp := topology.Default()
	tp.Consumers = append(tp.Consumers, topology.Consumer{Name: "multi", MaxReceiveCount: 3,
		Filter: map[string][]string{envelope.AttrAggregateType: {"order", "invoice"}, envelope.AttrEventType: {"x.paid"}}})
	a := FromTopology(tp)
	if err := a.Prepare(); err != nil {
		t.Fatal(err)
	}
	c, _ := a.Consumer("multi")
	if len(c.Bindings) != 2 || c.Bindings[1].Headers[envelope.AttrAggregateType] != "invoice" || c.Bindings[1].Headers[envelope.AttrEventType] != "x.paid" {
		t.Errorf("bindings %+v", c.Bindings)
	}
	if c.Retry.MaxRetries != 2 {
		t.Errorf("MaxReceiveCount 3 gave %d retries, want 2", c.Retry.MaxRetries)
	}
	audit, _ := a.Consumer("audit")
	if len(audit.Bindings) != 1 || len(audit.Bindings[0].Headers) != 0 {
		t.Errorf("unfiltered consumer bindings %+v, want one that matches everything", audit.Bindings)
	}
}

func TestLoadTopologyFromJSON(t *testing.T) {
	b, err := json.Marshal(Ticketing())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "t.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := LoadTopology(path)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := got.Consumer("inventory")
	if got.Exchange.Name != "ticketing.events" || c.Retry.MaxRetries != 3 || c.Retry.Delay(3) != 4*time.Second {
		t.Errorf("round trip lost fields: %+v", got)
	}
	if _, err := ParseTopology([]byte(`{"exchange":{"name":"e","kind":"fanout"},"consumers":[{"name":"c"}],"typo":1}`)); err == nil {
		t.Error("an unknown field was accepted")
	}
	for _, name := range []string{"default", "holdco", "ticketing", "corewrite"} {
		if _, err := LoadTopology(name); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestConfigFromEnvNamesTheVariable(t *testing.T) {
	t.Setenv(EnvTopology, "/no/such/file.json")
	if _, err := ConfigFromEnv(); err == nil || !strings.Contains(err.Error(), EnvTopology) {
		t.Errorf("error %v does not name %s", err, EnvTopology)
	}
	t.Setenv(EnvTopology, "holdco")
	t.Setenv(EnvURL, "http://wrong")
	if _, err := ConfigFromEnv(); err == nil || !strings.Contains(err.Error(), EnvURL) {
		t.Errorf("error %v does not name %s", err, EnvURL)
	}
	t.Setenv(EnvURL, "")
	c, err := ConfigFromEnv()
	if err != nil || c.URL != DefaultURL || c.Topology.Exchange.Name != "holdco.events" {
		t.Errorf("defaults: %+v %v", c, err)
	}
}

func TestHeaderInt(t *testing.T) {
	for _, tt := range []struct {
		v    any
		want int
	}{{int32(3), 3}, {int64(4), 4}, {float64(5), 5}, {"6", 6}, {nil, 0}, {"x", 0}, {int8(2), 2}} {
		if got := headerInt(tt.v); got != tt.want {
			t.Errorf("headerInt(%#v) = %d, want %d", tt.v, got, tt.want)
		}
	}
}

// The quorum queue delivers a message DeliveryLimit+1 times (x-delivery-count
// 0 to the limit): the last is the one whose count equals the limit, with
// the header as the runner (int64) or the Lambda's JSON (float64) gives it.
func TestLastDeliveryAtTheLimit(t *testing.T) {
	for _, tt := range []struct {
		limit int
		h     amqp091.Table
		want  bool
	}{
		{20, amqp091.Table{}, false},
		{20, amqp091.Table{"x-delivery-count": int64(19)}, false},
		{20, amqp091.Table{"x-delivery-count": int64(20)}, true},
		{2, amqp091.Table{"x-delivery-count": float64(2)}, true},
		{0, amqp091.Table{"x-delivery-count": int64(50)}, false}, // classic queue: no limit
	} {
		if got := (Consumer{DeliveryLimit: tt.limit}).lastDelivery(tt.h); got != tt.want {
			t.Errorf("limit %d, headers %v: last delivery %t, want %t", tt.limit, tt.h, got, tt.want)
		}
	}
}
