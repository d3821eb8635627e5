package amqp

import (
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/outbox"
)

func TestTopicMatch(t *testing.T) {
	for _, tc := range []struct {
		pattern, key string
		want         bool
	}{
		{"#", "invoice.created", true},
		{"#", "", true},
		{"invoice.*", "invoice.created", true},
		{"invoice.*", "invoice.created.v2", false},
		{"invoice.#", "invoice", true},
		{"invoice.#", "invoice.a.b", true},
		{"*.failed", "payment_intent.failed", true},
		{"*.failed", "payment_intent.succeeded", false},
		{"order.confirmed", "order.confirmed", true},
		{"order.confirmed", "order.cancelled", false},
		{"#.failed", "a.b.failed", true},
		{"*", "", true}, // "" splits into one empty word
	} {
		if got := topicMatch(strings.Split(tc.pattern, "."), strings.Split(tc.key, ".")); got != tc.want {
			t.Errorf("%q ~ %q = %v, want %v", tc.pattern, tc.key, got, tc.want)
		}
	}
}

// Replay's selection follows the bindings of the holdco example: erp
// (queue erp.sync) takes invoice.* and payment_intent.*, notifications order.* and
// payment_intent.failed, analytics everything.
func TestSelectsFollowsBindings(t *testing.T) {
	topo, err := LoadTopology("holdco")
	if err != nil {
		t.Fatal(err)
	}
	ops, err := NewOperations(Config{URL: DefaultURL, Topology: topo})
	if err != nil {
		t.Fatal(err)
	}
	defer ops.Close()
	msg := func(aggType, evType string) outbox.Message {
		return outbox.Message{AggregateType: aggType, EventType: evType, GroupID: "a-1", EventID: "e"}
	}
	for _, tc := range []struct {
		consumer string
		m        outbox.Message
		want     bool
	}{
		{"erp", msg("invoice", "created"), true},
		{"erp", msg("order", "created"), false},
		{"notifications", msg("payment_intent", "failed"), true},
		{"notifications", msg("payment_intent", "succeeded"), false},
		{"analytics", msg("anything", "at.all"), true},
	} {
		got, err := ops.Selects(tc.consumer, tc.m)
		if err != nil || got != tc.want {
			t.Errorf("%s selects %s.%s = %v (%v), want %v", tc.consumer, tc.m.AggregateType, tc.m.EventType, got, err, tc.want)
		}
	}
	if _, err := ops.Selects("nobody", msg("order", "created")); err == nil {
		t.Error("unknown consumer accepted")
	}
}
