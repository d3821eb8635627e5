package nats

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Stream storage and retention kinds.
const (
	StorageFile   = "file"
	StorageMemory = "memory"

	// RetentionInterest keeps a message until every consumer whose filter
	// selects it has acknowledged it: nothing is lost while a consumer is
	// down, and nothing piles up once all have applied it.
	RetentionInterest = "interest"
	// RetentionLimits keeps messages until MaxAge or MaxBytes (with
	// discard-new, so a full stream refuses publishes rather than dropping
	// the oldest, unconsumed messages).
	RetentionLimits = "limits"
)

// Headers the publisher sets on every message. HeaderMsgID is JetStream's
// deduplication id: a republish of the same event inside the stream's
// duplicate window is acknowledged as a duplicate and not stored again.
const (
	HeaderMsgID         = "Nats-Msg-Id"
	HeaderEventID       = "Fifobox-Event-Id"
	HeaderEventType     = "Fifobox-Event-Type"
	HeaderAggregateType = "Fifobox-Aggregate-Type"
	HeaderAggregateID   = "Fifobox-Aggregate-Id"
	HeaderSequence      = "Fifobox-Sequence"
	HeaderTenantID      = "Fifobox-Tenant-Id"
	// HeaderTraceparent keeps the W3C name (lower case) so tracing
	// propagators find it.
	HeaderTraceparent = "traceparent"
	HeaderContentType = "Content-Type"
)

// Headers fifobox sets on messages it dead-letters, and removes when
// redriving them.
const (
	HeaderErrorClass  = "Fifobox-Error-Class"
	HeaderErrorReason = "Fifobox-Error-Reason"
	HeaderConsumer    = "Fifobox-Consumer"
	HeaderDeadAt      = "Fifobox-Dead-At"
	// HeaderDeliveries is how often the consumer had received the message
	// when it was dead-lettered.
	HeaderDeliveries = "Fifobox-Deliveries"
	// HeaderSubject and HeaderStreamSeq say where the dead message was.
	HeaderSubject   = "Fifobox-Subject"
	HeaderStreamSeq = "Fifobox-Stream-Seq"
	// HeaderRedriven counts how often a message was moved back from the DLQ.
	HeaderRedriven = "Fifobox-Redriven"
)

// DefaultDeliverySlack is how many deliveries beyond MaxRetries+1 a
// consumer's MaxDeliver allows by default: redeliveries that were not
// failures (a runner restarted, a connection dropped while a message was in
// hand) must not make the server give up on a message before the runner has
// dead-lettered it itself.
const DefaultDeliverySlack = 10

// Topology is a JetStream layout as data: one stream holding every event
// under a subject prefix, a dead-letter stream, and per consumer a durable
// pull consumer with its filter subjects and retry policy. Provisioner
// creates it idempotently; Publisher, Runner and Operations all derive
// subjects and names from it, so they cannot drift.
//
// Subjects, for prefix "billing":
//
//	billing.<subject transport.Template>               events, e.g. billing.invoice.paid
//	billing_replay.<consumer>.<template>     redrive and replay to one consumer
//	billing_dlq.<consumer>                   the consumer's dead letters (DLQ stream)
//
// The replay and DLQ subjects sit beside the prefix, not under it, so a
// consumer filtering "billing.>" never sees another consumer's replays.
type Topology struct {
	// Stream is the events stream's name. Required.
	Stream string `json:"stream"`
	// SubjectPrefix is one or more subject tokens ("billing", "t1.billing")
	// every event subject starts with. Required.
	SubjectPrefix string `json:"subject_prefix"`
	// Subject is the template of an event's subject after the prefix.
	// Default "{aggregate_type}.{event_type}" (fields: event_id, event_type,
	// aggregate_type, aggregate_id, sequence, tenant_id, traceparent). Field
	// values are sanitised to one token each (SanitizeToken), so the
	// template's dots alone decide the subject's shape.
	Subject string `json:"subject,omitempty"`
	// Headers maps extra header names to templates; a header whose template
	// is a single field that is empty for a message is left out.
	Headers map[string]string `json:"headers,omitempty"`
	// Storage is "file" (default) or "memory".
	Storage string `json:"storage,omitempty"`
	// Replicas is the stream's replication factor (1-5; 3 in a production
	// cluster). Default 1.
	Replicas int `json:"replicas,omitempty"`
	// Retention is "interest" (default) or "limits".
	Retention string `json:"retention,omitempty"`
	// MaxAge, if set, drops events older than this whether consumed or not.
	MaxAge transport.Duration `json:"max_age,omitempty"`
	// MaxBytes, if set, bounds the stream; a publish that would exceed it is
	// refused (retryable) rather than dropping old events.
	MaxBytes int64 `json:"max_bytes,omitempty"`
	// MaxMsgSize is the largest message the stream takes; a bigger event is
	// a permanent publish failure. Default 1 MiB (the server's default
	// max_payload).
	MaxMsgSize int32 `json:"max_msg_size,omitempty"`
	// DuplicateWindow is how long JetStream remembers a Nats-Msg-Id. It must
	// cover the dispatcher's republish of an event whose acknowledgement was
	// lost: the next attempt comes at most a backoff ceiling later, or a lease
	// later from another dispatcher, so DuplicateWindow >= DispatcherLease +
	// DispatcherBackoffCap. Later republishes (after a long outage) reach the
	// stream again and the consumers' inboxes drop them. Default 10m.
	DuplicateWindow transport.Duration `json:"duplicate_window,omitempty"`
	// DispatcherLease and DispatcherBackoffCap are the dispatcher's Lease and
	// BackoffCap (outbox.DispatcherConfig), for checking DuplicateWindow.
	// Defaults 60s and 5m, the dispatcher's defaults.
	DispatcherLease      transport.Duration `json:"dispatcher_lease,omitempty"`
	DispatcherBackoffCap transport.Duration `json:"dispatcher_backoff_cap,omitempty"`
	// DeadLetterStream holds every consumer's dead letters. Default
	// "<stream>_DLQ".
	DeadLetterStream string `json:"dead_letter_stream,omitempty"`
	// DeadLetterMaxAge is how long dead letters are kept. Default 14 days
	// (topology.DLQRetention; inbox rows must outlast it).
	DeadLetterMaxAge transport.Duration `json:"dead_letter_max_age,omitempty"`
	// Consumers each get a durable pull consumer on the stream.
	Consumers []Consumer `json:"consumers"`
	// Unrouted is what happens to an event no consumer's filters select.
	// Default: delivered and reported (transport.UnroutedDeliver).
	Unrouted Unrouted `json:"unrouted,omitzero"`

	subject transport.Template
	headers map[string]transport.Template
	// eventFilters are the consumers' filters under the prefix, split into
	// tokens once (the publisher checks every unrouted candidate).
	eventFilters [][]string
}

// Unrouted is the topology's policy for events that no consumer's filters
// select, including an event whose subject no stream captures (see
// transport.UnroutedDeliver and transport.UnroutedAlternate).
type Unrouted struct {
	// Policy is "deliver" (default: the event is published as usual, and
	// if the stream does not capture its subject it still counts as
	// delivered; reported either way) or "alternate" (it is published to
	// "<subject>.<event subject after the prefix>" instead, which the
	// dead-letter stream keeps for DeadLetterMaxAge).
	Policy string `json:"policy,omitempty"`
	// Subject is the alternate policy's subject prefix. Default
	// "<subject_prefix>_unrouted".
	Subject string `json:"subject,omitempty"`
}

// Consumer is one subscriber: a durable pull consumer with explicit
// acknowledgement.
type Consumer struct {
	// Name is the consumer's inbox key and its durable consumer's name:
	// letters, digits, '-' and '_' (NATS names cannot hold '.').
	Name string `json:"name"`
	// Filters select the events the consumer receives: subject patterns
	// after the prefix ("invoice.*", "payment_intent.failed", ">" for every
	// event). Required.
	Filters []string `json:"filters"`
	// Retry is the redelivery schedule for transient failures (NakWithDelay
	// with its delays); the zero value means transport.RetryPolicy's
	// defaults.
	Retry transport.RetryPolicy `json:"retry"`
	// MaxDeliver is the server's delivery limit, a backstop for a runner that
	// dies on a message every time; the runner dead-letters a failing message
	// itself after Retry.MaxRetries. Default MaxRetries+1+DefaultDeliverySlack;
	// -1 for no limit.
	MaxDeliver int `json:"max_deliver,omitempty"`
	// AckWait is how long the server waits for an acknowledgement before it
	// redelivers. The runner extends it (in-progress) for messages it holds
	// behind a retrying one. Default 60s.
	AckWait transport.Duration `json:"ack_wait,omitempty"`
	// MaxAckPending bounds the messages delivered and not yet acknowledged,
	// including those held behind a retrying event of their aggregate.
	// Default 1000.
	MaxAckPending int `json:"max_ack_pending,omitempty"`
	// Workers is how many aggregates the runner applies at once. Default 8.
	Workers int `json:"workers,omitempty"`
	// Batch is how many messages the runner pulls per request. Default 100.
	Batch int `json:"batch,omitempty"`
}

// Durable is the durable consumer's name.
func (c Consumer) Durable() string { return c.Name }

// Consumer returns the consumer with the given name.
func (t *Topology) Consumer(name string) (Consumer, bool) {
	for _, c := range t.Consumers {
		if c.Name == name {
			return c, true
		}
	}
	return Consumer{}, false
}

// StreamSubjects are the events stream's subjects.
func (t *Topology) StreamSubjects() []string {
	return []string{t.SubjectPrefix + ".>", t.replayPrefix() + ".>"}
}

// DeadLetterSubjects are the dead-letter stream's subjects (and the
// alternate unrouted policy's).
func (t *Topology) DeadLetterSubjects() []string {
	if t.Unrouted.Policy == transport.UnroutedAlternate {
		return []string{t.dlqPrefix() + ".>", t.Unrouted.Subject + ".>"}
	}
	return []string{t.dlqPrefix() + ".>"}
}

// UnroutedSubject is where the alternate policy publishes m: the unrouted
// subject prefix and m's subject after the events prefix.
func (t *Topology) UnroutedSubject(m *outbox.Message) string {
	return t.Unrouted.Subject + "." + t.subject.Render(m, SanitizeToken)
}

// selectedByAny reports whether some consumer's filters select subject.
func (t *Topology) selectedByAny(subject string) bool {
	toks := strings.Split(subject, ".")
	for _, f := range t.eventFilters {
		if tokensMatch(f, toks) {
			return true
		}
	}
	return false
}

func tokensMatch(p, s []string) bool {
	for i, tok := range p {
		switch {
		case tok == ">":
			return len(s) > i
		case i >= len(s):
			return false
		case tok != "*" && tok != s[i]:
			return false
		}
	}
	return len(p) == len(s)
}

func (t *Topology) replayPrefix() string { return t.SubjectPrefix + "_replay" }
func (t *Topology) dlqPrefix() string    { return t.SubjectPrefix + "_dlq" }

// ReplaySubjectPrefix is where redrive and replay publish to one consumer:
// "<prefix>_replay.<consumer>" (its filters include "<that>.>").
func (t *Topology) ReplaySubjectPrefix(c Consumer) string { return t.replayPrefix() + "." + c.Name }

// DLQSubject is the consumer's subject in the dead-letter stream.
func (t *Topology) DLQSubject(c Consumer) string { return t.dlqPrefix() + "." + c.Name }

// FilterSubjects are the consumer's full filter subjects: its filters under
// the prefix, and its replay subject.
func (t *Topology) FilterSubjects(c Consumer) []string {
	out := make([]string, 0, len(c.Filters)+1)
	for _, f := range c.Filters {
		out = append(out, t.SubjectPrefix+"."+f)
	}
	return append(out, t.ReplaySubjectPrefix(c)+".>")
}

// Selects reports whether the consumer's filters select subject (NATS
// matching: '*' one token, '>' one or more at the end). The runner checks it
// too: on servers before 2.10 a consumer has one filter subject at most, so
// a consumer with several reads the whole stream and skips what its filters
// do not select.
func (t *Topology) Selects(c Consumer, subject string) bool {
	for _, f := range t.FilterSubjects(c) {
		if SubjectMatches(f, subject) {
			return true
		}
	}
	return false
}

// EventSubject is the subject m is published on.
func (t *Topology) EventSubject(m *outbox.Message) string {
	return t.SubjectPrefix + "." + t.subject.Render(m, SanitizeToken)
}

// SubjectMatches is NATS subject matching of pattern against a literal subject.
func SubjectMatches(pattern, subject string) bool {
	return tokensMatch(strings.Split(pattern, "."), strings.Split(subject, "."))
}

func (t *Topology) setDefaults() {
	if t.Subject == "" {
		t.Subject = "{aggregate_type}.{event_type}"
	}
	if t.Storage == "" {
		t.Storage = StorageFile
	}
	if t.Replicas == 0 {
		t.Replicas = 1
	}
	if t.Retention == "" {
		t.Retention = RetentionInterest
	}
	if t.MaxMsgSize == 0 {
		t.MaxMsgSize = 1 << 20
	}
	defd := func(p *transport.Duration, v time.Duration) {
		if *p == 0 {
			*p = transport.Duration(v)
		}
	}
	defd(&t.DuplicateWindow, 10*time.Minute)
	defd(&t.DispatcherLease, 60*time.Second)
	defd(&t.DispatcherBackoffCap, 5*time.Minute)
	defd(&t.DeadLetterMaxAge, topology.DLQRetention)
	if t.DeadLetterStream == "" && t.Stream != "" {
		t.DeadLetterStream = t.Stream + "_DLQ"
	}
	if t.Unrouted.Policy == "" {
		t.Unrouted.Policy = transport.UnroutedDeliver
	}
	if t.Unrouted.Policy == transport.UnroutedAlternate && t.Unrouted.Subject == "" && t.SubjectPrefix != "" {
		t.Unrouted.Subject = t.SubjectPrefix + "_unrouted"
	}
	for i := range t.Consumers {
		c := &t.Consumers[i]
		c.Retry = c.Retry.WithDefaults()
		if c.MaxDeliver == 0 {
			c.MaxDeliver = c.Retry.MaxRetries + 1 + DefaultDeliverySlack
		}
		defd(&c.AckWait, 60*time.Second)
		if c.MaxAckPending == 0 {
			c.MaxAckPending = 1000
		}
		if c.Workers == 0 {
			c.Workers = 8
		}
		if c.Batch == 0 {
			c.Batch = min(100, c.MaxAckPending)
		}
	}
}

var (
	nameRE       = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
	prefixRE     = regexp.MustCompile(`^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$`)
	headerNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)
)

// Prepare applies defaults, validates every field and parses the templates.
// Publisher, Provisioner and the consumers call it; call it yourself to
// check a topology kept as data.
func (t *Topology) Prepare() error {
	t.setDefaults()
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	if !nameRE.MatchString(t.Stream) {
		add("stream %q: must be 1-64 letters, digits, '_' or '-'", t.Stream)
	}
	if !prefixRE.MatchString(t.SubjectPrefix) || len(t.SubjectPrefix) > 100 {
		add("subject_prefix %q: must be dot-separated tokens of letters, digits, '_' or '-', at most 100 bytes", t.SubjectPrefix)
	}
	var err error
	if t.subject, err = transport.ParseTemplate(t.Subject); err != nil {
		add("subject: %v", err)
	} else if strings.ContainsAny(t.Subject, "*> \t\r\n") {
		add("subject %q: wildcards and whitespace are not allowed", t.Subject)
	} else {
		// Render with every field set: the literal dots must leave no empty token.
		probe := outbox.Message{EventID: "x", EventType: "x", AggregateType: "x", GroupID: "x",
			Attributes: map[string]string{envelope.AttrTenantID: "x", envelope.AttrTraceparent: "x"}}
		if s := t.subject.Render(&probe, SanitizeToken); !validSubject(s) {
			add("subject %q: renders to %q, which has an empty token", t.Subject, s)
		}
	}
	t.headers = map[string]transport.Template{}
	for _, name := range sortedKeys(t.Headers) {
		if !headerNameRE.MatchString(name) || reservedHeader(name) {
			add("headers[%q]: header names are 1-128 letters, digits, '_' or '-', not Nats-* or Fifobox-*", name)
		}
		tpl, err := transport.ParseTemplate(t.Headers[name])
		if err != nil {
			add("headers[%q]: %v", name, err)
		}
		t.headers[name] = tpl
	}
	switch {
	case t.Storage != StorageFile && t.Storage != StorageMemory:
		add("storage %q: must be file or memory", t.Storage)
	case t.Replicas < 1 || t.Replicas > 5:
		add("replicas %d: must be 1-5", t.Replicas)
	case t.Retention != RetentionInterest && t.Retention != RetentionLimits:
		add("retention %q: must be interest or limits", t.Retention)
	case t.MaxAge < 0 || t.MaxBytes < 0:
		add("max_age %s, max_bytes %d: must not be negative", time.Duration(t.MaxAge), t.MaxBytes)
	case t.MaxMsgSize < 1024:
		add("max_msg_size %d: must be at least 1024", t.MaxMsgSize)
	case t.DispatcherLease <= 0 || t.DispatcherBackoffCap <= 0:
		add("dispatcher_lease %s, dispatcher_backoff_cap %s: must be positive", time.Duration(t.DispatcherLease), time.Duration(t.DispatcherBackoffCap))
	case t.DuplicateWindow < t.DispatcherLease+t.DispatcherBackoffCap:
		add("duplicate_window %s: must be at least dispatcher_lease %s + dispatcher_backoff_cap %s, or a republish after a lost acknowledgement is stored twice",
			time.Duration(t.DuplicateWindow), time.Duration(t.DispatcherLease), time.Duration(t.DispatcherBackoffCap))
	case t.DeadLetterMaxAge < transport.Duration(time.Hour):
		add("dead_letter_max_age %s: must be at least 1h", time.Duration(t.DeadLetterMaxAge))
	}
	if !nameRE.MatchString(t.DeadLetterStream) || t.DeadLetterStream == t.Stream {
		add("dead_letter_stream %q: must be a valid stream name other than the events stream", t.DeadLetterStream)
	}
	if len(t.Consumers) == 0 {
		add("consumers: at least one consumer is required")
	}
	if err := transport.CheckUnroutedPolicy(t.Unrouted.Policy); err != nil {
		add("%v", err)
	}
	if u := t.Unrouted.Subject; t.Unrouted.Policy == transport.UnroutedAlternate {
		probe := u + ".x"
		taken := false
		for _, p := range append(t.StreamSubjects(), t.dlqPrefix()+".>") {
			taken = taken || SubjectMatches(p, probe)
		}
		if !prefixRE.MatchString(u) || len(u) > 100 || taken {
			add("unrouted.subject %q: must be dot-separated tokens outside the events, replay and dead-letter subjects", u)
		}
	} else if u != "" {
		add("unrouted.subject %q: only with policy %s", u, transport.UnroutedAlternate)
	}
	t.eventFilters = nil
	names := map[string]bool{}
	for i, c := range t.Consumers {
		p := fmt.Sprintf("consumers[%d]", i)
		if !nameRE.MatchString(c.Name) {
			add("%s.name %q: must be 1-64 letters, digits, '_' or '-'", p, c.Name)
		}
		if names[c.Name] {
			add("%s.name %q: duplicate", p, c.Name)
		}
		names[c.Name] = true
		if len(c.Filters) == 0 {
			add("%s.filters: at least one filter is required (\">\" for every event)", p)
		}
		for j, f := range c.Filters {
			if !validPattern(f) {
				add("%s.filters[%d] %q: not a subject pattern (tokens, '*' for one, '>' last for the rest)", p, j, f)
			}
			t.eventFilters = append(t.eventFilters, strings.Split(t.SubjectPrefix+"."+f, "."))
		}
		if err := c.Retry.Validate(); err != nil {
			add("%s.retry: %v", p, err)
		}
		if c.MaxDeliver != -1 && c.MaxDeliver <= c.Retry.MaxRetries+1 {
			add("%s.max_deliver %d: must exceed max_retries+1 (%d), or -1 for no limit", p, c.MaxDeliver, c.Retry.MaxRetries+1)
		}
		if c.AckWait < transport.Duration(time.Second) {
			add("%s.ack_wait %s: must be at least 1s", p, time.Duration(c.AckWait))
		}
		if c.MaxAckPending < 1 || c.MaxAckPending > 100000 {
			add("%s.max_ack_pending %d: must be 1-100000", p, c.MaxAckPending)
		}
		if c.Workers < 1 || c.Workers > 1000 {
			add("%s.workers %d: must be 1-1000", p, c.Workers)
		}
		if c.Batch < 1 || c.Batch > c.MaxAckPending {
			add("%s.batch %d: must be 1-max_ack_pending", p, c.Batch)
		}
	}
	return errors.Join(errs...)
}

func reservedHeader(name string) bool {
	l := strings.ToLower(name)
	return strings.HasPrefix(l, "nats-") || strings.HasPrefix(l, "fifobox-") || l == "traceparent" || l == "content-type"
}

// validSubject: non-empty tokens, no wildcards, no whitespace.
func validSubject(s string) bool {
	if s == "" || len(s) > 4096 {
		return false
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" || strings.ContainsAny(tok, "*> \t\r\n") {
			return false
		}
	}
	return true
}

// validPattern: a subject whose tokens may be '*', and whose last may be '>'.
func validPattern(s string) bool {
	if s == "" || strings.ContainsAny(s, " \t\r\n") {
		return false
	}
	toks := strings.Split(s, ".")
	for i, tok := range toks {
		switch {
		case tok == "":
			return false
		case tok == ">":
			if i != len(toks)-1 {
				return false
			}
		case tok == "*":
		case strings.ContainsAny(tok, "*>"):
			return false
		}
	}
	return true
}

// ParseTopology reads a topology from JSON and prepares it.
func ParseTopology(b []byte) (Topology, error) {
	var t Topology
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&t); err != nil {
		return Topology{}, fmt.Errorf("parse nats topology: %w", err)
	}
	if err := t.Prepare(); err != nil {
		return Topology{}, fmt.Errorf("nats topology: %w", err)
	}
	return t, nil
}

// LoadTopology returns a built-in topology by name ("default", "holdco",
// "ticketing", "corewrite"), parses one given as JSON (a value starting
// with "{"), or reads one from a JSON file.
func LoadTopology(nameOrPath string) (Topology, error) {
	var t Topology
	var err error
	switch nameOrPath {
	case "", "default":
		t, err = FromTopology(topology.Default())
		if err != nil {
			return Topology{}, err
		}
	case "holdco":
		t = Holdco()
	case "ticketing":
		t = Ticketing()
	case "corewrite":
		t = Corewrite()
	default:
		if strings.HasPrefix(strings.TrimSpace(nameOrPath), "{") {
			// The JSON itself: a Lambda has no file to point at.
			return ParseTopology([]byte(nameOrPath))
		}
		b, err := os.ReadFile(nameOrPath)
		if err != nil {
			return Topology{}, fmt.Errorf("load nats topology: %w", err)
		}
		return ParseTopology(b)
	}
	if err := t.Prepare(); err != nil {
		return Topology{}, fmt.Errorf("nats topology %s: %w", nameOrPath, err)
	}
	return t, nil
}

// FromTopology maps fifobox's transport-neutral topology onto JetStream:
// stream FIFOBOX, subjects "fifobox.<aggregate_type>.<event_type>", and per
// consumer one filter per allowed combination of aggregate_type and
// event_type values ('*' where the filter does not constrain one), with
// the consumer's retry budget (topology.Consumer.Retries) and, as the
// server's delivery limit (max_deliver), its redelivery backstop
// (ReceiveLimit) when that leaves room for the budget. Subjects carry no tenant, so a filter on any
// other attribute cannot be mapped and is an error.
func FromTopology(tp topology.Topology) (Topology, error) {
	t := Topology{Stream: "FIFOBOX", SubjectPrefix: "fifobox", Subject: "{aggregate_type}.{event_type}"}
	for _, c := range tp.Consumers {
		for k := range c.Filter {
			if k != envelope.AttrAggregateType && k != envelope.AttrEventType {
				return Topology{}, fmt.Errorf("nats topology from %s: consumer %s filters on %s; subjects carry only aggregate_type and event_type", tp.Topic.Name, c.Name, k)
			}
		}
		aggs, types := c.Filter[envelope.AttrAggregateType], c.Filter[envelope.AttrEventType]
		if len(aggs) == 0 {
			aggs = []string{"*"}
		}
		if len(types) == 0 {
			types = []string{"*"}
		}
		nc := Consumer{Name: c.Name, Retry: transport.RetryPolicy{
			MaxRetries: c.Retries(), InitialDelay: transport.Duration(time.Second),
			Multiplier: 2, MaxDelay: transport.Duration(5 * time.Minute)}}
		if n := c.ReceiveLimit(); n > c.Retries()+1+DefaultDeliverySlack {
			nc.MaxDeliver = n
		}
		for _, a := range aggs {
			for _, e := range types {
				f := func(v string) string {
					if v == "*" {
						return v
					}
					return SanitizeToken(v)
				}
				nc.Filters = append(nc.Filters, f(a)+"."+f(e))
			}
		}
		if len(c.Filter) == 0 {
			nc.Filters = []string{">"}
		}
		t.Consumers = append(t.Consumers, nc)
	}
	return t, nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
