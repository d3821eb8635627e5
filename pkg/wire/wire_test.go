package wire_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/proccpu"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/wire"
)

// message is e as the dispatcher hands it to a publisher on its attempt-th try.
func message(t testing.TB, e envelope.Envelope, attempt int) outbox.Message {
	t.Helper()
	body, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return outbox.Message{ID: 7, EventID: e.ID, GroupID: e.AggregateID, AggregateType: e.AggregateType, Sequence: e.Sequence,
		EventType: e.Type, Body: body, Attributes: e.Attributes(), Attempt: attempt}
}

var occurred = time.Date(2025, 12, 21, 22, 30, 0, 0, time.UTC)

func event(typ, aggType, aggID, payload string) envelope.Envelope {
	return envelope.Envelope{ID: "0190f5a2-7b3c-7d4e-8f00-123456789abc", Type: typ, OccurredAt: occurred,
		AggregateType: aggType, AggregateID: aggID, Sequence: 3, TenantID: "tnt_1", SchemaVersion: 1, Payload: json.RawMessage(payload)}
}

func mapper(t testing.TB, name, transport string) *wire.Mapper {
	t.Helper()
	p, err := wire.Load(name)
	if err != nil {
		t.Fatal(err)
	}
	m, err := p.Mapper(transport)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// The built-in profiles render each document's message exactly: body,
// headers and properties.
func TestBuiltInProfilesRenderTheDocumentsMessages(t *testing.T) {
	holdcoBody := `{"event_id":"0190f5a2-7b3c-7d4e-8f00-123456789abc","occurred_at":"2025-12-21T22:30:00Z","aggregate_type":"order",` +
		`"aggregate_id":"5b1c1a3e-0000-4000-8000-000000000001","event_type":"created","group_id":"9e0c0000-0000-4000-8000-00000000000a",` +
		`"subsidiary_id":null,"payload":{"order_no":"ORD-0001","total_amount":"125000.00","currency":"NGN"}}`
	tests := []struct {
		profile, transport string
		event              envelope.Envelope
		attempt            int
		body               string
		headers            []wire.Header
		dest, msgID, typ   string
		timestamp          time.Time
		group, dedup       string
	}{
		{
			profile: "holdco", transport: wire.TransportRabbitMQ, attempt: 3,
			event: func() envelope.Envelope {
				e := event("created", "order", "5b1c1a3e-0000-4000-8000-000000000001", holdcoBody)
				e.TenantID = "9e0c0000-0000-4000-8000-00000000000a"
				return e
			}(),
			body: holdcoBody,
			headers: []wire.Header{
				{"x-aggregate-id", "5b1c1a3e-0000-4000-8000-000000000001"}, {"x-aggregate-type", "order"}, {"x-attempts", int64(2)},
				{"x-event-id", "0190f5a2-7b3c-7d4e-8f00-123456789abc"}, {"x-event-type", "created"},
				{"x-group-id", "9e0c0000-0000-4000-8000-00000000000a"}, // x-subsidiary-id: null in the body, so left out
			},
			dest: "order.created", msgID: "0190f5a2-7b3c-7d4e-8f00-123456789abc", typ: "created", timestamp: occurred,
		},
		{
			profile: "corewrite", transport: wire.TransportRabbitMQ, attempt: 1,
			event: event("ProductCreated", "PRD", "PRD-42", `{"PRD_ID":"PRD-42","XPRD01":"Widget"}`),
			body: `{"OUTBOX_ID":"0190f5a2-7b3c-7d4e-8f00-123456789abc","EVENT_TYPE":"ProductCreated","AGGREGATE_TYPE":"PRD",` +
				`"AGGREGATE_ID":"PRD-42","PAYLOAD":{"PRD_ID":"PRD-42","XPRD01":"Widget"}}`,
			headers: []wire.Header{{"x-event-id", "0190f5a2-7b3c-7d4e-8f00-123456789abc"}, {"x-event-type", "ProductCreated"}},
			msgID:   "0190f5a2-7b3c-7d4e-8f00-123456789abc", typ: "ProductCreated", timestamp: occurred,
		},
		{
			profile: "ticketing", transport: wire.TransportRabbitMQ, attempt: 4,
			event: event("hold.created", "hold", "6f1e0000-0000-4000-8000-000000000002", `{"seat":"A1"}`),
			body: `{"event_id":"0190f5a2-7b3c-7d4e-8f00-123456789abc","event_type":"hold.created","occurred_at":"2025-12-21T22:30:00Z",` +
				`"aggregate_id":"6f1e0000-0000-4000-8000-000000000002","idempotency_key":"0190f5a2-7b3c-7d4e-8f00-123456789abc","payload":{"seat":"A1"}}`,
			headers: []wire.Header{{"x-retry-count", int64(0)}},
			dest:    "hold.created", msgID: "0190f5a2-7b3c-7d4e-8f00-123456789abc", typ: "hold.created", timestamp: occurred,
		},
		{
			profile: "corebilling", transport: wire.TransportNATS, attempt: 1,
			event: func() envelope.Envelope {
				e := event("subscription.created", "subscription", "sub_1", `{"id":"sub_1","customer_id":"cus_1"}`)
				e.CorrelationID = "corr-1"
				return e
			}(),
			body: `{"id":"01J3TT4YSWFN78Y00J6HB7H6NW","subject":"subscription.created","tenantId":"tnt_1","createdAt":"2025-12-21T22:30:00Z",` +
				`"data":{"id":"sub_1","customer_id":"cus_1"},"metadata":{"correlation_id":"corr-1","tenant_id":"tnt_1","subject":"subscription.created"}}`,
			headers: []wire.Header{{"correlation-id", "corr-1"}, {"tenant-id", "tnt_1"}},
			dest:    "subscription.created", msgID: "01J3TT4YSWFN78Y00J6HB7H6NW",
		},
		{
			profile: "transfers", transport: wire.TransportSNS, attempt: 2,
			event: event("events.transfers.submitted.usdc", "transfer", "tr_123", `{"amount":{"value":"100.00","currency":"USD"}}`),
			body: `{"envelope":{"v":1,"eventId":"0190f5a2-7b3c-7d4e-8f00-123456789abc","occurredAt":"2025-12-21T22:30:00Z","tenantId":"tnt_1",` +
				`"type":"events.transfers.submitted.usdc"},"key":{"transferId":"tr_123"},"payload":{"amount":{"value":"100.00","currency":"USD"}}}`,
			headers: []wire.Header{{"aggregate_type", "transfer"}, {"event_type", "events.transfers.submitted.usdc"}, {"tenant_id", "tnt_1"}},
			group:   "tr_123", dedup: "0190f5a2-7b3c-7d4e-8f00-123456789abc",
		},
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			m := mapper(t, tt.profile, tt.transport)
			msg := message(t, tt.event, tt.attempt)
			got, err := m.Render(&msg)
			if err != nil {
				t.Fatal(err)
			}
			if string(got.Body) != tt.body {
				t.Errorf("body\n got %s\nwant %s", got.Body, tt.body)
			}
			if !json.Valid(got.Body) {
				t.Errorf("body is not JSON")
			}
			if !reflect.DeepEqual(got.Headers, tt.headers) {
				t.Errorf("headers\n got %v\nwant %v", got.Headers, tt.headers)
			}
			if got.Destination != tt.dest || got.MessageID != tt.msgID || got.Type != tt.typ || !got.Timestamp.Equal(tt.timestamp) ||
				got.GroupID != tt.group || got.DedupID != tt.dedup || got.ContentType != "application/json" {
				t.Errorf("properties: dest %q id %q type %q ts %v group %q dedup %q content %q", got.Destination, got.MessageID, got.Type,
					got.Timestamp, got.GroupID, got.DedupID, got.ContentType)
			}
		})
	}
}

// Each mistake a profile can hold is refused by Parse with the path of
// the profile field at fault, before anything is provisioned or published.
func TestProfileMistakesNameTheField(t *testing.T) {
	amqp := func(extra string) string {
		return `{"name":"p","body":{"id":"{event_id}"},"rabbitmq":{"exchange":"ev","routing_key":"{event_type}",` +
			`"exchanges":[{"name":"ev","type":"topic"},{"name":"dlx","type":"direct"}],` + extra + `}}`
	}
	okQueues := `"queues":[{"name":"q","bindings":[{"exchange":"ev","key":"#"}]}]`
	tests := []struct {
		name, json string
		want       []string // every fragment must appear in the error
	}{
		{"unknown member", `{"name":"p","bodee":{}}`, []string{`unknown field "bodee"`}},
		{"name", `{"name":"P Q","body":"{payload}"}`, []string{`name "P Q"`}},
		{"no body", `{"name":"p","rabbitmq":{"exchange":"ev","exchanges":[{"name":"ev","type":"fanout"}],` + okQueues + `}}`, []string{"body: required"}},
		{"unknown body field", `{"name":"p","body":{"a":{"b":"{group}"}},"nats":{"subject":"x","stream":{"name":"S","subjects":["x"]}}}`,
			[]string{"body.a.b: unknown field {group}"}},
		{"attempt in body", `{"name":"p","body":{"n":"{publish_attempt}"},"nats":{"subject":"x","stream":{"name":"S","subjects":["x"]}}}`,
			[]string{"body: {publish_attempt} differs between attempts"}},
		{"payload body without key paths", `{"name":"p","body":"{payload}","keys":{"event_id":"id","event_type":"type"},` +
			`"nats":{"subject":"x","stream":{"name":"S","subjects":["x"]}}}`,
			[]string{"keys.aggregate_id: required", "keys.aggregate_type: required"}},
		{"empty key path segment", `{"name":"p","body":{"id":"{event_id}"},"keys":{"aggregate_id":"key..transferId"},` +
			`"nats":{"subject":"x","stream":{"name":"S","subjects":["x"]}}}`, []string{`keys["aggregate_id"] "key..transferId"`}},
		{"key for no field", `{"name":"p","body":{"id":"{event_id}"},"keys":{"group":"g"},` +
			`"nats":{"subject":"x","stream":{"name":"S","subjects":["x"]}}}`, []string{`keys["group"]: not an event field`}},
		{"optional in array", `{"name":"p","body":{"a":["{tenant_id?}"]},"nats":{"subject":"x","stream":{"name":"S","subjects":["x"]}}}`,
			[]string{"body.a[0]: '?' leaves out an object member"}},
		{"no transport", `{"name":"p","body":{"id":"{event_id}"}}`, []string{"rabbitmq, nats or sns"}},
		{"publish exchange not declared", `{"name":"p","body":{"id":"{event_id}"},"rabbitmq":{"exchange":"other","routing_key":"k",` +
			`"exchanges":[{"name":"ev","type":"topic"}],` + okQueues + `}}`, []string{`rabbitmq.exchange "other": not in rabbitmq.exchanges`}},
		{"routing key missing", `{"name":"p","body":{"id":"{event_id}"},"rabbitmq":{"exchange":"ev",` +
			`"exchanges":[{"name":"ev","type":"topic"}],` + okQueues + `}}`, []string{"rabbitmq.routing_key: required for the topic exchange"}},
		{"header field", amqp(okQueues + `,"headers":{"x-group-id":"{group_id}"}`), []string{`rabbitmq.headers["x-group-id"]: unknown field {group_id}`}},
		{"header whole payload", amqp(okQueues + `,"headers":{"x-p":"{payload}"}`), []string{`rabbitmq.headers["x-p"]: {payload} is the whole payload`}},
		{"reserved header", amqp(okQueues + `,"headers":{"x-death":"1"}`), []string{`rabbitmq.headers["x-death"]: reserved`}},
		{"policy typo", amqp(`"queues":[{"name":"q","bindings":[{"exchange":"ev","key":"#"}],"policy":{"dead-letter-exchnage":"dlx"}}]`),
			[]string{`rabbitmq.queues[0].policy["dead-letter-exchnage"]: not a queue policy key`}},
		{"policy type", amqp(`"queues":[{"name":"q","bindings":[{"exchange":"ev","key":"#"}],"policy":{"message-ttl":"60s"}}]`),
			[]string{`rabbitmq.queues[0].policy["message-ttl"]: must be a int`}},
		{"dead-letter exchange not declared", amqp(`"queues":[{"name":"q","bindings":[{"exchange":"ev","key":"#"}],` +
			`"arguments":{"x-dead-letter-exchange":"nowhere","x-dead-letter-routing-key":"q.dlq"}}]`),
			[]string{`rabbitmq.queues[0]: dead-letter exchange "nowhere" is not in rabbitmq.exchanges`}},
		{"dead letters nobody receives", amqp(`"queues":[{"name":"q","bindings":[{"exchange":"ev","key":"#"}],` +
			`"policy":{"dead-letter-exchange":"dlx","dead-letter-routing-key":"q.dlq"}},{"name":"q.dlq","bindings":[{"exchange":"dlx","key":"q.dead"}]}]`),
			[]string{`rabbitmq.queues[0]: dead letters go to exchange "dlx" with routing key "q.dlq", but no queue`}},
		{"binding to an undeclared exchange", amqp(`"queues":[{"name":"q","bindings":[{"exchange":"elsewhere","key":"#"}]}]`),
			[]string{`rabbitmq.queues[0].bindings[0].exchange "elsewhere": not in rabbitmq.exchanges`}},
		{"queue declared twice", amqp(`"queues":[{"name":"q","bindings":[{"exchange":"ev","key":"#"}]},{"name":"q"}]`),
			[]string{`rabbitmq.queues[1].name "q": declared twice`}},
		{"nats subject", `{"name":"p","body":{"id":"{event_id}"},"nats":{"subject":"{event_kind}","stream":{"name":"S","subjects":["a.>.b"]}}}`,
			[]string{"nats.subject: unknown field {event_kind}", `nats.stream.subjects[0] "a.>.b"`}},
		{"sns names with dots", `{"name":"p","body":{"id":"{event_id}"},"sns":{"topic":"events.transfers.fifo",` +
			`"subscriptions":[{"name":"gateway.usdc","delivery":"envelope"}]}}`,
			[]string{`sns.topic "events.transfers.fifo"`, `sns.subscriptions[0].name "gateway.usdc"`, `sns.subscriptions[0].delivery "envelope"`}},
		{"sns filter on no attribute", `{"name":"p","body":{"id":"{event_id}"},"sns":{"topic":"t.fifo","attributes":{"type":"{event_type}"},` +
			`"subscriptions":[{"name":"q","filter":{"event_type":["a"]}}]}}`, []string{`sns.subscriptions[0].filter["event_type"]: not one of sns.attributes`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := wire.Parse([]byte(tt.json))
			if err == nil {
				t.Fatal("Parse accepted it")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
		})
	}
}

// A body read back through the profile gives the event fifobox stored:
// what a producer writing the system's own shape enqueues, and what a
// reader finds in a message. A body that lacks a value the keys name is a
// KeyError naming the key.
func TestEnvelopeReadsTheBodyBack(t *testing.T) {
	for _, tt := range []struct{ profile, transport, aggType string }{
		{"corewrite", wire.TransportRabbitMQ, "PRD"},
		{"ticketing", wire.TransportRabbitMQ, "ticketing"},
		{"transfers", wire.TransportSNS, "transfer"},
	} {
		t.Run(tt.profile, func(t *testing.T) {
			m := mapper(t, tt.profile, tt.transport)
			e := event("order.confirmed", tt.aggType, "agg-9", `{"n":1}`)
			e.TenantID = ""
			msg := message(t, e, 1)
			w, err := m.Render(&msg)
			if err != nil {
				t.Fatal(err)
			}
			back, err := m.Profile().Envelope(w.Body)
			if err != nil {
				t.Fatal(err)
			}
			if back.ID != e.ID || back.Type != e.Type || back.AggregateType != e.AggregateType || back.AggregateID != e.AggregateID ||
				string(back.Payload) != string(e.Payload) {
				t.Errorf("read back %+v\nfrom %s", back, w.Body)
			}
			if err := back.Validate(); err != nil {
				t.Errorf("read-back envelope does not validate: %v", err)
			}
		})
	}
	t.Run("holdco body missing its aggregate", func(t *testing.T) {
		p, _ := wire.Load("holdco")
		_, err := p.Envelope([]byte(`{"event_id":"0190f5a2-7b3c-7d4e-8f00-123456789abc","event_type":"created","aggregate_type":"order"}`))
		var ke *wire.KeyError
		if !errors.As(err, &ke) || ke.Field != "aggregate_id" || ke.Path != "aggregate_id" {
			t.Fatalf("got %v, want a KeyError for keys.aggregate_id", err)
		}
	})
	t.Run("corebilling body carries no aggregate", func(t *testing.T) {
		p, _ := wire.Load("corebilling")
		if err := p.Reversible(); err == nil || !strings.Contains(err.Error(), "keys.aggregate_id") {
			t.Fatalf("Reversible: %v, want the missing keys.aggregate_id named", err)
		}
	})
	t.Run("ULID read back as the stored UUID", func(t *testing.T) {
		p, err := wire.Parse([]byte(`{"name":"u","event_id_format":"ulid","body":{"id":"{event_id}","t":"{event_type}",` +
			`"a":"{aggregate_id}","data":"{payload}"},"defaults":{"aggregate_type":"x"},"nats":{"subject":"{event_type}","stream":{"name":"S","subjects":["x.>"]}}}`))
		if err != nil {
			t.Fatal(err)
		}
		e, err := p.Envelope([]byte(`{"id":"01j3tt4yswfn78y00j6hb7h6nw","t":"x.y","a":"a1","data":{}}`))
		if err != nil || e.ID != "0190f5a2-7b3c-7d4e-8f00-123456789abc" {
			t.Fatalf("got %q, %v", e.ID, err)
		}
		_, err = p.Envelope([]byte(`{"id":"not-a-ulid","t":"x.y","a":"a1","data":{}}`))
		var ke *wire.KeyError
		if !errors.As(err, &ke) || ke.Field != "event_id" {
			t.Fatalf("bad ULID: %v", err)
		}
	})
}

// Template details: optional members, alternatives, interpolation, typed
// literals, string escaping as Go's encoder does it, empty headers left out.
func TestTemplates(t *testing.T) {
	p, err := wire.Parse([]byte(`{"name":"t","body":{"lit":[1,2.5,true,null,"plain"],"opt":"{causation_id?}","alt":"{causation_id|correlation_id}",
		"mix":"{aggregate_type}/{aggregate_id}#{sequence}","seq":"{sequence}","deep":"{payload.a.b}","absent":"{payload.nope}","tenant":"{tenant_id}",
		"when":"{occurred_at_unix}"},
		"rabbitmq":{"exchange":"ev","routing_key":"{event_type}","timestamp":"none","headers":{"x-n":7,"x-b":false,"x-s":"{causation_id}","x-mix":"v{sequence}","x-deep":"{payload.a.b}"},
		"exchanges":[{"name":"ev","type":"topic"}],"queues":[{"name":"q","bindings":[{"exchange":"ev","key":"#"}]}]}}`))
	if err != nil {
		t.Fatal(err)
	}
	m, err := p.Mapper(wire.TransportRabbitMQ)
	if err != nil {
		t.Fatal(err)
	}
	e := event("a.b", "order", `o"1`, `{"a":{"b":"q\"\u2028 ü"}}`)
	e.TenantID = "t\u2029ü"
	e.CorrelationID = "corr"
	msg := message(t, e, 1)
	got, err := m.Render(&msg)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"lit":[1,2.5,true,null,"plain"],"alt":"corr","mix":"order/o\"1#3","seq":3,"deep":"q\"\u2028 ü","absent":null,` +
		`"tenant":"t\u2029ü","when":1766356200}`
	if string(got.Body) != want {
		t.Errorf("body\n got %s\nwant %s", got.Body, want)
	}
	var v map[string]any
	if err := json.Unmarshal(got.Body, &v); err != nil || v["tenant"] != "t\u2029ü" {
		t.Errorf("body does not decode to the values: %v %v", err, v)
	}
	wantH := []wire.Header{{"x-b", false}, {"x-deep", "q\"\u2028 ü"}, {"x-mix", "v3"}, {"x-n", int64(7)}}
	if !reflect.DeepEqual(got.Headers, wantH) {
		t.Errorf("headers %v, want %v", got.Headers, wantH)
	}
	if !got.Timestamp.IsZero() {
		t.Errorf("timestamp none: got %v", got.Timestamp)
	}
}

// A group id SNS would refuse is an error at render time, which the
// publisher reports as permanent (the event goes dead, loudly), never
// sent with a group id the emulator accepts and AWS does not.
func TestRenderRefusesBadGroupAndSubject(t *testing.T) {
	m := mapper(t, "transfers", wire.TransportSNS)
	e := event("x", "transfer", "tr 1", `{}`)
	msg := message(t, e, 1)
	if _, err := m.Render(&msg); err == nil || !strings.Contains(err.Error(), "sns.group_id") {
		t.Errorf("group id with a space: %v", err)
	}
	n := mapper(t, "corebilling", wire.TransportNATS)
	e = event("subscription..created", "s", "s1", `{}`)
	msg = message(t, e, 1)
	if _, err := n.Render(&msg); err == nil || !strings.Contains(err.Error(), "nats.subject") {
		t.Errorf("subject with an empty token: %v", err)
	}
	if _, err := n.Profile().Mapper(wire.TransportRabbitMQ); err == nil {
		t.Error("a profile without a rabbitmq section compiled for rabbitmq")
	}
}

func TestIDFormats(t *testing.T) {
	for _, id := range []string{"0190f5a2-7b3c-7d4e-8f00-123456789abc", "00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff"} {
		m := mapper(t, "corebilling", wire.TransportNATS)
		e := event("subscription.created", "s", "s1", `{}`)
		e.ID = id
		msg := message(t, e, 1)
		got, err := m.Render(&msg)
		if err != nil {
			t.Fatal(err)
		}
		if len(got.MessageID) != 26 {
			t.Fatalf("%s -> %q: not a ULID", id, got.MessageID)
		}
		back, err := wire.ULID.Stored(got.MessageID)
		if err != nil || back != id {
			t.Errorf("%s -> %s -> %s (%v)", id, got.MessageID, back, err)
		}
	}
}

// Render is safe for the dispatcher's concurrent Publish calls.
func TestRenderConcurrently(t *testing.T) {
	m := mapper(t, "ticketing", wire.TransportRabbitMQ)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 200; i++ {
				e := event("hold.created", "hold", fmt.Sprintf("h-%d-%d", g, i), fmt.Sprintf(`{"i":%d}`, i))
				msg := message(t, e, 1)
				got, err := m.Render(&msg)
				if err != nil || !strings.Contains(string(got.Body), fmt.Sprintf(`"aggregate_id":"h-%d-%d"`, g, i)) {
					t.Errorf("render: %v %s", err, got.Body)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// Every built-in profile loads by name and from its file.
func TestBuiltInProfilesLoad(t *testing.T) {
	names := wire.Names()
	if strings.Join(names, ",") != "corebilling,corewrite,holdco,ticketing,transfers" {
		t.Fatalf("built-in profiles %v", names)
	}
	for _, n := range names {
		if _, err := wire.Load("../../profiles/" + n + ".json"); err != nil {
			t.Errorf("%s from its file: %v", n, err)
		}
	}
	if _, err := wire.Load("nosuch"); err == nil || !strings.Contains(err.Error(), "built-in: corebilling") {
		t.Errorf("unknown name: %v", err)
	}
	t.Setenv(wire.EnvProfile, "")
	if p, err := wire.FromEnv(); p != nil || err != nil {
		t.Errorf("unset: %v %v", p, err)
	}
	t.Setenv(wire.EnvProfile, `{"name":"x"}`)
	if _, err := wire.FromEnv(); err == nil || !strings.Contains(err.Error(), wire.EnvProfile) {
		t.Errorf("bad inline profile: %v, want the variable named", err)
	}
}

// BenchmarkRender is the publisher-side cost of a profile per event: a
// passthrough body with headers read from the payload (holdco), template
// bodies (ticketing, transfers, corebilling with ULIDs), beside the native
// envelope's (which publishes the stored body as it is: no work).
//
//	go test -run '^$' -bench BenchmarkRender ./pkg/wire/
func BenchmarkRender(b *testing.B) {
	payload := `{"order_no":"ORD-0001","total_amount":"125000.00","currency":"NGN","note":"` + strings.Repeat("x", 200) + `"}`
	holdco := fmt.Sprintf(`{"event_id":"0190f5a2-7b3c-7d4e-8f00-123456789abc","occurred_at":"2025-12-21T22:30:00Z","aggregate_type":"order",`+
		`"aggregate_id":"o-1","event_type":"created","group_id":"g-1","subsidiary_id":"s-1","payload":%s}`, payload)
	for _, c := range []struct{ profile, transport, payload string }{
		{"holdco", wire.TransportRabbitMQ, holdco},
		{"ticketing", wire.TransportRabbitMQ, payload},
		{"transfers", wire.TransportSNS, payload},
		{"corebilling", wire.TransportNATS, payload},
	} {
		b.Run(c.profile, func(b *testing.B) {
			m := mapper(b, c.profile, c.transport)
			msg := message(b, event("created", "order", "o-1", c.payload), 1)
			b.SetBytes(int64(len(msg.Body)))
			b.ReportAllocs()
			// CPU time, not wall time: on a shared machine the wall clock
			// counts the waits for a core too.
			cpu := proccpu.Self()
			for i := 0; i < b.N; i++ {
				if _, err := m.Render(&msg); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64((proccpu.Self()-cpu).Nanoseconds())/float64(b.N), "cpu-ns/op")
		})
	}
}

// The example in docs/wire-profiles.md is a profile Parse accepts, and it
// is profiles/ticketing.json (which declares the notification queues too).
func TestDocsExampleIsTheTicketingProfile(t *testing.T) {
	md, err := os.ReadFile("../../docs/wire-profiles.md")
	if err != nil {
		t.Fatal(err)
	}
	s := string(md)
	i := strings.Index(s, "```json\n")
	j := strings.Index(s[i+8:], "```")
	if i < 0 || j < 0 {
		t.Fatal("no json example in docs/wire-profiles.md")
	}
	doc, err := wire.Parse([]byte(s[i+8 : i+8+j]))
	if err != nil {
		t.Fatalf("the docs' example: %v", err)
	}
	built, err := wire.Load("ticketing")
	if err != nil {
		t.Fatal(err)
	}
	built.RabbitMQ.Queues = built.RabbitMQ.Queues[:2]
	built.Description = ""
	a, _ := json.Marshal(doc)
	b, _ := json.Marshal(built)
	if !bytes.Equal(a, b) {
		t.Errorf("the docs' example differs from profiles/ticketing.json:\n%s\n%s", a, b)
	}
}

func TestRabbitMQSelects(t *testing.T) {
	for _, tt := range []struct {
		profile, key string
		want         bool
	}{
		{"holdco", "order.created", true}, {"holdco", "anything.at_all", true}, // analytics.ingest binds #
		{"ticketing", "hold.created", true}, {"ticketing", "order.cancelled", true}, {"ticketing", "order.created", false},
		{"ticketing", "hold.created.extra", false}, {"corewrite", "", true},
	} {
		p, err := wire.Load(tt.profile)
		if err != nil {
			t.Fatal(err)
		}
		if got := p.RabbitMQ.Selects(tt.key); got != tt.want {
			t.Errorf("%s selects %q: %v, want %v", tt.profile, tt.key, got, tt.want)
		}
	}
}
