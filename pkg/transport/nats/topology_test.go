package nats

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
)

func TestSanitizeToken(t *testing.T) {
	for in, want := range map[string]string{
		"invoice": "invoice", "order.paid": "order_paid", "a b\tc": "a_b_c", "*": "_", ">": "_", "": "_",
		"naïve-Ümlaut": "naïve-Ümlaut", "x\ny": "x_y",
	} {
		if got := SanitizeToken(in); got != want {
			t.Errorf("SanitizeToken(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestSubjectMatches(t *testing.T) {
	tests := []struct {
		pat, subj string
		want      bool
	}{
		{"a.>", "a.b", true}, {"a.>", "a.b.c", true}, {"a.>", "a", false},
		{"a.*", "a.b", true}, {"a.*", "a.b.c", false}, {"*.b", "a.b", true},
		{"a.b", "a.b", true}, {"a.b", "a.c", false}, {">", "a", true},
		{"p.invoice.*", "p_replay.erp.invoice.paid", false},
	}
	for _, tt := range tests {
		if got := SubjectMatches(tt.pat, tt.subj); got != tt.want {
			t.Errorf("SubjectMatches(%q, %q) = %v", tt.pat, tt.subj, got)
		}
	}
}

func TestSubjectsAndFilters(t *testing.T) {
	topo := Holdco()
	if err := topo.Prepare(); err != nil {
		t.Fatal(err)
	}
	m := &outbox.Message{EventID: "e-1", EventType: "paid", AggregateType: "invoice", GroupID: "inv-1"}
	if s := topo.EventSubject(m); s != "holdco.invoice.paid" {
		t.Errorf("subject %q", s)
	}
	erp, _ := topo.Consumer("erp")
	notif, _ := topo.Consumer("notifications")
	if got := topo.FilterSubjects(erp); strings.Join(got, " ") != "holdco.invoice.* holdco.payment_intent.* holdco_replay.erp.>" {
		t.Errorf("erp filters %v", got)
	}
	if !topo.Selects(erp, "holdco.invoice.paid") || topo.Selects(notif, "holdco.invoice.paid") {
		t.Error("filters select the wrong consumers")
	}
	// A replay for erp is erp's only, even for a consumer filtering ">".
	an, _ := topo.Consumer("analytics")
	if topo.Selects(an, "holdco_replay.erp.invoice.paid") || !topo.Selects(erp, "holdco_replay.erp.invoice.paid") {
		t.Error("a replay subject leaks to another consumer")
	}
	if got := topo.StreamSubjects(); strings.Join(got, " ") != "holdco.> holdco_replay.>" {
		t.Errorf("stream subjects %v", got)
	}
	if topo.DLQSubject(erp) != "holdco_dlq.erp" || topo.DeadLetterStream != "HOLDCO_DLQ" {
		t.Errorf("dead letters at %s in %s", topo.DLQSubject(erp), topo.DeadLetterStream)
	}
}

func TestHeadersFor(t *testing.T) {
	topo := Corewrite()
	topo.Headers = map[string]string{"X-Tenant": "{tenant_id}", "X-Key": "{aggregate_type}/{aggregate_id}"}
	if err := topo.Prepare(); err != nil {
		t.Fatal(err)
	}
	m := &outbox.Message{EventID: "e-1", EventType: "doc.written", AggregateType: "doc", GroupID: "d\n1", Sequence: 3,
		Attributes: map[string]string{envelope.AttrTraceparent: "00-abc-def-01"}}
	h := topo.headersFor(m)
	if h.Get(HeaderAggregateID) != "d 1" || h.Get(HeaderSequence) != "3" || h["traceparent"][0] != "00-abc-def-01" {
		t.Errorf("headers %v", h)
	}
	if _, ok := h["X-Tenant"]; ok {
		t.Errorf("an empty single-field header was set: %v", h)
	}
	if _, ok := h[HeaderTenantID]; ok {
		t.Errorf("an empty tenant was set: %v", h)
	}
	if h.Get("X-Key") != "doc/d 1" {
		t.Errorf("X-Key %q", h.Get("X-Key"))
	}
}

func TestPrepareNamesTheBadField(t *testing.T) {
	tests := []struct {
		name  string
		edit  func(*Topology)
		field string
	}{
		{"stream", func(t *Topology) { t.Stream = "a.b" }, "stream"},
		{"prefix", func(t *Topology) { t.SubjectPrefix = "a.*" }, "subject_prefix"},
		{"template field", func(t *Topology) { t.Subject = "{nope}" }, "subject"},
		{"template wildcard", func(t *Topology) { t.Subject = "{event_type}.>" }, "subject"},
		{"template empty token", func(t *Topology) { t.Subject = "{event_type}..x" }, "subject"},
		{"duplicate window", func(t *Topology) { t.DuplicateWindow = transport.Duration(time.Minute) }, "duplicate_window"},
		{"window vs dispatcher", func(t *Topology) {
			t.DuplicateWindow = transport.Duration(10 * time.Minute)
			t.DispatcherBackoffCap = transport.Duration(10 * time.Minute)
		}, "duplicate_window"},
		{"replicas", func(t *Topology) { t.Replicas = 7 }, "replicas"},
		{"storage", func(t *Topology) { t.Storage = "tape" }, "storage"},
		{"filter", func(t *Topology) { t.Consumers[0].Filters = []string{"a.>.b"} }, "consumers[0].filters[0]"},
		{"no filter", func(t *Topology) { t.Consumers[0].Filters = nil }, "consumers[0].filters"},
		{"consumer name", func(t *Topology) { t.Consumers[0].Name = "a.b" }, "consumers[0].name"},
		{"duplicate consumer", func(t *Topology) { t.Consumers[1].Name = t.Consumers[0].Name }, "consumers[1].name"},
		{"max deliver", func(t *Topology) { t.Consumers[0].MaxDeliver = 3 }, "consumers[0].max_deliver"},
		{"retry", func(t *Topology) { t.Consumers[0].Retry = transport.RetryPolicy{MaxRetries: 99} }, "consumers[0].retry"},
		{"reserved header", func(t *Topology) { t.Headers = map[string]string{"Nats-Msg-Id": "{event_id}"} }, "headers"},
		{"dead-letter stream", func(t *Topology) { t.DeadLetterStream = t.Stream }, "dead_letter_stream"},
	}
	for _, tt := range tests {
		topo := Holdco()
		tt.edit(&topo)
		err := topo.Prepare()
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("%s: %v, want an error naming %s", tt.name, err, tt.field)
		}
	}
	for _, topo := range []Topology{Holdco(), Ticketing(), Corewrite()} {
		if err := topo.Prepare(); err != nil {
			t.Errorf("%s: %v", topo.Stream, err)
		}
	}
}

func TestTopologyIsData(t *testing.T) {
	topo := Ticketing()
	if err := topo.Prepare(); err != nil {
		t.Fatal(err)
	}
	b, err := json.MarshalIndent(topo, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseTopology(b)
	if err != nil {
		t.Fatalf("round trip: %v\n%s", err, b)
	}
	if back.Consumers[0].Retry != topo.Consumers[0].Retry || back.DuplicateWindow != topo.DuplicateWindow {
		t.Errorf("round trip changed the topology: %+v", back)
	}
	if _, err := ParseTopology([]byte(`{"stream":"S","subject_prefix":"s","consumers":[{"name":"c","filters":[">"]}],"bogus":1}`)); err == nil {
		t.Error("an unknown field was accepted")
	}
	path := filepath.Join(t.TempDir(), "topo.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadTopology(path); err != nil {
		t.Error(err)
	}
	for _, name := range []string{"", "default", "holdco", "ticketing", "corewrite"} {
		if _, err := LoadTopology(name); err != nil {
			t.Errorf("%q: %v", name, err)
		}
	}
}

func TestFromTopology(t *testing.T) {
	n, err := FromTopology(topology.Default())
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Prepare(); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"orders-projection": "order.*", "shipping": "*.order_paid", "audit": ">"}
	for _, c := range n.Consumers {
		if strings.Join(c.Filters, ",") != want[c.Name] || c.Retry.MaxRetries != 4 {
			t.Errorf("%s: filters %v retries %d", c.Name, c.Filters, c.Retry.MaxRetries)
		}
	}
	tp := topology.Default()
	tp.Consumers[0].Filter = map[string][]string{envelope.AttrTenantID: {"acme"}}
	if _, err := FromTopology(tp); err == nil || !strings.Contains(err.Error(), "tenant_id") {
		t.Errorf("a tenant filter: %v, want an error", err)
	}
}

func TestConfigFromEnv(t *testing.T) {
	t.Setenv(EnvURL, "nats://a:4222,nats://b:4222")
	t.Setenv(EnvTopology, "holdco")
	t.Setenv(EnvStream, "BILLING")
	t.Setenv(EnvSubjectPrefix, "billing")
	t.Setenv(EnvSubject, "{aggregate_type}.{event_type}.{tenant_id}")
	t.Setenv(EnvUser, "svc")
	t.Setenv(EnvPassword, "s3cret")
	t.Setenv(EnvPingInterval, "3s")
	c, err := ConfigFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if c.Topology.Stream != "BILLING" || c.Topology.DeadLetterStream != "BILLING_DLQ" || c.Topology.SubjectPrefix != "billing" || c.User != "svc" ||
		c.PingInterval != 3*time.Second {
		t.Errorf("config %+v", c)
	}
	m := &outbox.Message{EventType: "paid", AggregateType: "invoice", Attributes: map[string]string{envelope.AttrTenantID: "acme"}}
	if s := c.Topology.EventSubject(m); s != "billing.invoice.paid.acme" {
		t.Errorf("subject %q", s)
	}

	for _, tt := range []struct{ env, value, want string }{
		{EnvURL, "http://x", EnvURL},
		{EnvStream, "A.B", "stream"},
		{EnvSubject, "{nope}", "subject"},
		{EnvCredsFile, "/x.creds", EnvCredsFile},
		{EnvPingInterval, "often", EnvPingInterval},
		{EnvPingInterval, "-5s", EnvPingInterval},
		{EnvPingInterval, "10ms", EnvPingInterval},
	} {
		t.Run(tt.env, func(t *testing.T) {
			t.Setenv(tt.env, tt.value)
			if _, err := ConfigFromEnv(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("%s=%s: %v, want an error naming %s", tt.env, tt.value, err, tt.want)
			}
		})
	}
}
