package topology

import (
	"testing"

	"github.com/fifobox/fifobox/pkg/envelope"
)

func TestUnselected(t *testing.T) {
	top := Default()
	// audit takes everything: nothing is unselected.
	if top.Unselected(map[string]string{envelope.AttrEventType: "refund.issued", envelope.AttrAggregateType: "refund"}) {
		t.Error("an event the audit consumer takes counted as unselected")
	}
	top.Consumers = top.Consumers[:2] // orders-projection (order) and shipping (order.paid)
	for attrs, want := range map[[2]string]bool{
		{"refund.issued", "refund"}: true,
		{"order.paid", "payment"}:   false,
		{"order.created", "order"}:  false,
	} {
		got := top.Unselected(map[string]string{envelope.AttrEventType: attrs[0], envelope.AttrAggregateType: attrs[1]})
		if got != want {
			t.Errorf("%v: Unselected = %v, want %v", attrs, got, want)
		}
	}
}
