package transport_test

import (
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

func TestTemplates(t *testing.T) {
	m := &outbox.Message{EventID: "e-1", EventType: "paid", AggregateType: "invoice", GroupID: "inv-9", Sequence: 7,
		Attributes: map[string]string{envelope.AttrTenantID: "acme"}}
	tests := []struct{ tpl, want string }{
		{"{aggregate_type}.{event_type}", "invoice.paid"},
		{"{event_type}", "paid"},
		{"tenant.{tenant_id}.{aggregate_id}#{sequence}", "tenant.acme.inv-9#7"},
		{"literal", "literal"},
		{"{traceparent}", ""},
		{"", ""},
	}
	for _, tt := range tests {
		tpl, err := transport.ParseTemplate(tt.tpl)
		if err != nil {
			t.Fatalf("%q: %v", tt.tpl, err)
		}
		if got := tpl.Render(m, nil); got != tt.want {
			t.Errorf("%q rendered %q, want %q", tt.tpl, got, tt.want)
		}
	}
	// clean applies to the fields' values only (NATS subject tokens).
	tpl, _ := transport.ParseTemplate("t.{event_type}.{aggregate_id}")
	if got := tpl.Render(&outbox.Message{EventType: "a.b", GroupID: "x"}, strings.ToUpper); got != "t.A.B.X" {
		t.Errorf("rendered with clean: %q", got)
	}
	one, _ := transport.ParseTemplate("{tenant_id}")
	if tpl.Single() || !one.Single() {
		t.Error("Single: want true for one field alone only")
	}
	for _, bad := range []string{"{nope}", "{event_type", "event_type}", "a}{event_type}"} {
		if _, err := transport.ParseTemplate(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
