package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"sort"
	"strings"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/profiles"
)

// Profile is one system's message contract as data. Parse prepares it;
// Mapper compiles it for one transport.
type Profile struct {
	// Name identifies the profile (FIFOBOX_PROFILE=<name> chooses a built-in one).
	Name string `json:"name"`
	// Document names the design the profile follows.
	Document string `json:"document,omitempty"`
	// Description says, for operators, what the profile makes fifobox do.
	Description string `json:"description,omitempty"`
	// EventIDFormat is how event ids are written on the wire: "uuid"
	// (default) or "ulid".
	EventIDFormat IDFormat `json:"event_id_format,omitempty"`
	// ContentType of every message. Default "application/json".
	ContentType string `json:"content_type,omitempty"`
	// Body is the message body as a JSON template (see the package doc), or
	// "{payload}": the event's payload is the whole body.
	Body json.RawMessage `json:"body"`
	// Keys say where in the body a reader finds each event field, as a
	// dotted member path ("key.transferId"). A template body implies them
	// (a member whose value is exactly "{aggregate_id}" holds the aggregate
	// id); a "{payload}" body needs them: event_id, event_type and
	// aggregate_id at least.
	Keys map[string]string `json:"keys,omitempty"`
	// Defaults are constant values for event fields the body does not carry
	// (e.g. "aggregate_type": "transfer"), used when reading a body back.
	Defaults map[string]string `json:"defaults,omitempty"`
	// RabbitMQ, NATS and SNS are the transport sections; a profile has at
	// least one.
	RabbitMQ *RabbitMQ `json:"rabbitmq,omitempty"`
	NATS     *NATS     `json:"nats,omitempty"`
	SNS      *SNS      `json:"sns,omitempty"`
	// Source, if set, is the producers' own outbox table, which fifobox
	// delivers from (pkg/capture).
	Source *Source `json:"source,omitempty"`

	body        node
	keys        map[string][]string
	payloadPath []string
}

// Transport section names, as FIFOBOX_TRANSPORT spells them.
const (
	TransportRabbitMQ = "rabbitmq"
	TransportNATS     = "nats"
	TransportSNS      = "sns"
)

// EnvProfile chooses a profile: a built-in name, a JSON file, or the JSON itself.
const EnvProfile = "FIFOBOX_PROFILE"

// Env declares the variable FromEnv reads.
var Env = envspec.Set{
	{Name: EnvProfile, Doc: "wire profile: a built-in name (" + strings.Join(Names(), ", ") + "), a JSON file, or the JSON itself; unset: fifobox's own envelope"},
}

// FromEnv loads the profile FIFOBOX_PROFILE names, or returns nil when it
// is unset. Errors name the variable.
func FromEnv() (*Profile, error) {
	v := Env.Get(EnvProfile)
	if strings.TrimSpace(v) == "" {
		return nil, nil
	}
	p, err := Load(v)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", EnvProfile, err)
	}
	return p, nil
}

// Names lists the built-in profiles (profiles/*.json).
func Names() []string {
	entries, _ := fs.Glob(profiles.FS, "*.json")
	out := make([]string, 0, len(entries))
	for _, e := range entries {
		out = append(out, strings.TrimSuffix(e, ".json"))
	}
	sort.Strings(out)
	return out
}

// Load returns a built-in profile by name, parses one given as JSON (a
// value starting with "{"), or reads one from a file.
func Load(nameOrPath string) (*Profile, error) {
	s := strings.TrimSpace(nameOrPath)
	var b []byte
	var err error
	switch {
	case strings.HasPrefix(s, "{"):
		b = []byte(s)
	case !strings.ContainsAny(s, "/\\.") && s != "":
		if b, err = profiles.FS.ReadFile(s + ".json"); err != nil {
			return nil, fmt.Errorf("no built-in profile %q (built-in: %s; or give a file path)", s, strings.Join(Names(), ", "))
		}
	default:
		if b, err = os.ReadFile(s); err != nil {
			return nil, fmt.Errorf("load profile: %w", err)
		}
	}
	return Parse(b)
}

// Parse reads a profile from JSON and checks every field. All problems are
// reported at once, each with the path of the field at fault.
func Parse(b []byte) (*Profile, error) {
	var p Profile
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	d.UseNumber()
	if err := d.Decode(&p); err != nil {
		return nil, fmt.Errorf("parse profile: %w", err)
	}
	if err := p.Prepare(); err != nil {
		if p.Name != "" {
			return nil, fmt.Errorf("profile %s: %w", p.Name, err)
		}
		return nil, fmt.Errorf("profile: %w", err)
	}
	return &p, nil
}

var profileNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,62}$`)

// keyFields are the event fields a body can carry and Keys can locate.
var keyFields = map[string]bool{
	"event_id": true, "event_type": true, "aggregate_type": true, "aggregate_id": true, "occurred_at": true,
	"tenant_id": true, "correlation_id": true, "causation_id": true, "traceparent": true,
}

// Prepare applies defaults and validates the profile; Parse calls it.
func (p *Profile) Prepare() error {
	var errs []error
	add := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if !profileNameRE.MatchString(p.Name) {
		add("name %q: 1-63 lower-case letters, digits, '-' or '_'", p.Name)
	}
	if p.EventIDFormat == "" {
		p.EventIDFormat = UUID
	}
	if !p.EventIDFormat.valid() {
		add("event_id_format %q: must be uuid or ulid", p.EventIDFormat)
	}
	if p.ContentType == "" {
		p.ContentType = "application/json"
	}
	var err error
	if p.body, err = compileBody(p.Body, "body"); err != nil {
		errs = append(errs, err)
	}
	for _, r := range p.body.refs() {
		if r.f.name == "publish_attempt" || r.f.name == "publish_retries" {
			// The body is what a consumer deduplicates and what a replay
			// re-sends: it must not change between attempts.
			add("body: {%s} differs between attempts of one event; put it in a header", r)
		}
	}
	p.keys = map[string][]string{}
	if err == nil {
		for f, path := range p.body.paths() {
			if keyFields[f] {
				p.keys[f] = path
			}
		}
		p.payloadPath = p.body.paths()["payload"]
	}
	for _, f := range sortedKeys(p.Keys) {
		if !keyFields[f] {
			add("keys[%q]: not an event field a body carries (%s)", f, strings.Join(sortedKeys(keyFields), ", "))
			continue
		}
		path := strings.Split(p.Keys[f], ".")
		if slicesContain(path, "") {
			add("keys[%q] %q: a dotted member path such as \"key.transferId\"", f, p.Keys[f])
			continue
		}
		p.keys[f] = path
	}
	for _, f := range sortedKeys(p.Defaults) {
		if !keyFields[f] || f == "event_id" || f == "aggregate_id" {
			add("defaults[%q]: only event_type, aggregate_type, tenant_id and the like can have a constant value", f)
		}
	}
	if p.body.passthrough() {
		// The body is whatever the producer wrote: fifobox must be told where
		// the event's identity is in it, or it cannot check or read it back.
		for _, f := range []string{"event_id", "event_type", "aggregate_id"} {
			if _, ok := p.keys[f]; !ok {
				add("keys.%s: required with a \"{payload}\" body: the member path in the body that holds the %s", f, strings.ReplaceAll(f, "_", " "))
			}
		}
		if _, ok := p.keys["aggregate_type"]; !ok && p.Defaults["aggregate_type"] == "" {
			add("keys.aggregate_type: required with a \"{payload}\" body (or defaults.aggregate_type)")
		}
	}
	n := 0
	if p.RabbitMQ != nil {
		n++
		errs = append(errs, p.RabbitMQ.prepare("rabbitmq")...)
	}
	if p.NATS != nil {
		n++
		errs = append(errs, p.NATS.prepare("nats")...)
	}
	if p.SNS != nil {
		n++
		errs = append(errs, p.SNS.prepare("sns")...)
	}
	if n == 0 {
		add("rabbitmq, nats or sns: a profile needs the section of the transport it is used with")
	}
	if p.Source != nil {
		errs = append(errs, p.Source.prepare("source", p.Defaults)...)
	}
	return errors.Join(errs...)
}

// Passthrough reports whether the body is the event's payload as the producer wrote it.
func (p *Profile) Passthrough() bool { return p.body.passthrough() }

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func slicesContain(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// normalize turns the json.Numbers of a decoded argument value into int64
// (integral) or float64, as AMQP tables need them.
func normalize(v any, at string) (any, error) {
	switch x := v.(type) {
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return i, nil
		}
		f, err := x.Float64()
		if err != nil {
			return nil, fmt.Errorf("%s: %v", at, err)
		}
		return f, nil
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			n, err := normalize(e, fmt.Sprintf("%s[%q]", at, k))
			if err != nil {
				return nil, err
			}
			out[k] = n
		}
		return out, nil
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			n, err := normalize(e, fmt.Sprintf("%s[%d]", at, i))
			if err != nil {
				return nil, err
			}
			out[i] = n
		}
		return out, nil
	case string, bool, nil:
		return x, nil
	}
	return nil, fmt.Errorf("%s: unsupported value %T", at, v)
}

func normalizeMap(m map[string]any, at string) (map[string]any, error) {
	if m == nil {
		return nil, nil
	}
	v, err := normalize(m, at)
	if err != nil {
		return nil, err
	}
	return v.(map[string]any), nil
}

// MapperFromEnv is FromEnv compiled for transport: nil when FIFOBOX_PROFILE
// is unset. Errors name the variable.
func MapperFromEnv(transport string) (*Mapper, error) {
	p, err := FromEnv()
	if err != nil || p == nil {
		return nil, err
	}
	m, err := p.Mapper(transport)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", EnvProfile, err)
	}
	return m, nil
}
