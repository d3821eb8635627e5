package nats

import (
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strings"

	"golang.org/x/crypto/bcrypt"
)

// Roles: what each fifobox function does on the NATS server, and so the
// subjects its own user may publish and subscribe to (Topology.Permissions).
// The provisioner alone may use the whole JetStream API.
const (
	// RoleDispatcher publishes events (and looks up the events stream when
	// nobody answers a publish).
	RoleDispatcher = "dispatcher"
	// RoleConsumer pulls and acknowledges from its own durable consumer and
	// publishes its own dead letters.
	RoleConsumer = "consumer"
	// RoleOperations reads and deletes dead letters, publishes to the
	// consumers' replay subjects, and reads stream and consumer state.
	RoleOperations = "operations"
	// RoleProvisioner creates streams and consumers: the whole JetStream API.
	RoleProvisioner = "provisioner"
)

// Permissions are a NATS user's allowed subjects (everything else is
// denied): what it may publish to (JetStream API requests are publishes)
// and subscribe to (its own reply inboxes).
type Permissions struct {
	Publish   []string `json:"publish"`
	Subscribe []string `json:"subscribe"`
}

// InboxPrefix is the reply-inbox prefix of user name's connections: its
// replies (PubAcks, pulled messages, API responses) arrive on
// "<prefix>.<id>", which only that user may subscribe to.
func InboxPrefix(user string) string {
	if user == "" || !tokenRE.MatchString(user) {
		return "_INBOX"
	}
	return "_INBOX." + user
}

var tokenRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)

// Permissions returns the subjects user (a name for its inbox) of role may
// use; consumer names the consumer for RoleConsumer.
func (t *Topology) Permissions(role, consumer, user string) (Permissions, error) {
	inbox := []string{InboxPrefix(user) + ".>"}
	api := "$JS.API."
	switch role {
	case RoleDispatcher:
		pub := []string{t.SubjectPrefix + ".>", api + "STREAM.INFO." + t.Stream}
		if t.Unrouted.Subject != "" {
			pub = append(pub, t.Unrouted.Subject+".>", api+"STREAM.INFO."+t.DeadLetterStream)
		}
		return Permissions{Publish: pub, Subscribe: inbox}, nil
	case RoleConsumer:
		c, ok := t.Consumer(consumer)
		if !ok {
			return Permissions{}, fmt.Errorf("nats permissions: consumer %q is not in the topology", consumer)
		}
		d := c.Durable()
		return Permissions{Publish: []string{
			api + "CONSUMER.INFO." + t.Stream + "." + d,
			api + "CONSUMER.MSG.NEXT." + t.Stream + "." + d,
			// Acknowledgements: v1 and v2 (domain, account hash) reply subjects.
			"$JS.ACK." + t.Stream + "." + d + ".>",
			"$JS.ACK.*.*." + t.Stream + "." + d + ".>",
			t.DLQSubject(c),
			api + "STREAM.INFO." + t.DeadLetterStream,
		}, Subscribe: inbox}, nil
	case RoleOperations:
		return Permissions{Publish: []string{
			api + "STREAM.INFO." + t.Stream,
			api + "STREAM.INFO." + t.DeadLetterStream,
			api + "CONSUMER.INFO." + t.Stream + ".*",
			api + "STREAM.MSG.GET." + t.DeadLetterStream,
			api + "DIRECT.GET." + t.DeadLetterStream,
			api + "STREAM.MSG.DELETE." + t.DeadLetterStream,
			t.replayPrefix() + ".>",
		}, Subscribe: inbox}, nil
	case RoleProvisioner:
		return Permissions{Publish: []string{api + ">"}, Subscribe: inbox}, nil
	}
	return Permissions{}, fmt.Errorf("nats permissions: role %q: must be %s, %s, %s or %s", role, RoleDispatcher, RoleConsumer, RoleOperations, RoleProvisioner)
}

// User is one function's NATS user for the server's configuration.
type User struct {
	Name, Password string
	// Role is RoleDispatcher, RoleConsumer, RoleOperations or RoleProvisioner.
	Role string
	// Consumer names the consumer (RoleConsumer only).
	Consumer string
}

// AuthorizationConfig renders users as a nats-server "authorization" block
// (JSON, which the server's configuration format accepts), passwords
// bcrypt-hashed, each user with only its role's permissions. NATS has no API
// to add users to a running server (outside operator mode): include the
// block in the server's configuration and reload it (nats-server --signal
// reload). Each function then connects with its user and password
// (FIFOBOX_NATS_SECRET_ARN, or FIFOBOX_NATS_USER and FIFOBOX_NATS_PASSWORD).
func (t *Topology) AuthorizationConfig(users []User) (string, error) {
	type perms struct {
		Publish   map[string][]string `json:"publish"`
		Subscribe map[string][]string `json:"subscribe"`
	}
	type entry struct {
		User        string `json:"user"`
		Password    string `json:"password"`
		Permissions perms  `json:"permissions"`
	}
	sorted := append([]User(nil), users...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Name < sorted[j].Name })
	var out []entry
	for _, u := range sorted {
		if !tokenRE.MatchString(u.Name) || u.Password == "" {
			return "", fmt.Errorf("nats user %q: needs a name of letters, digits, '-' or '_' and a password", u.Name)
		}
		p, err := t.Permissions(u.Role, u.Consumer, u.Name)
		if err != nil {
			return "", fmt.Errorf("nats user %s: %w", u.Name, err)
		}
		h, err := bcrypt.GenerateFromPassword([]byte(u.Password), bcrypt.DefaultCost)
		if err != nil {
			return "", fmt.Errorf("nats user %s: hash the password: %w", u.Name, err)
		}
		out = append(out, entry{User: u.Name, Password: string(h), Permissions: perms{
			Publish: map[string][]string{"allow": p.Publish}, Subscribe: map[string][]string{"allow": p.Subscribe}}})
	}
	var b strings.Builder
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false) // the server's parser knows no \u escapes ('>' in subjects)
	enc.SetIndent("", "  ")
	if err := enc.Encode(map[string]any{"authorization": map[string]any{"users": out}}); err != nil {
		return "", err
	}
	return b.String(), nil
}
