"""Month and weekday names of languages other than English, for a page's date words.

A page's BM25 row holds its date in words (``lexical.date_words``: ``monday 8 may 2023``), so
a question that names a month or a day finds the pages of that date. In English only, a
question in French (``en mai``) matched only the numbers. So a page written in one of these
languages (found from its words by the stopword lists: ``csrc/include/memoryos/languages.h``)
also gets its weekday and month in that language's words; an English page's row is as before.

A language that inflects month and day names has each name in the forms a question or a date
writes it (``a/b/c``): the nominative, and for Polish, Czech, Slovak, Russian and Ukrainian the
genitive of a date (``8 maja``, ``8 мая``) and the locative of "in May" (``w maju``, ``в мае``)
and the accusative of "on Wednesday" (``w środę``, ``в среду``); Finnish "in May" and "on
Monday" (``toukokuussa``, ``maanantaina``), Hungarian's (``májusban``, ``hétfőn``), Turkish
"in May" (``Mayıs'ta``, which splits as ``mayısta``). A page gets every form. An apostrophe
inside a word is dropped by the splitter (Ukrainian ``п'ятниця`` is ``пятниця``), but the
modifier letter ``ʼ`` is a letter: both spellings are listed.
"""

from __future__ import annotations

from memoryos_gpu.text.stopword_lists import LANGUAGES
from memoryos_gpu.text.words import normalise

#: By language (as :data:`~memoryos_gpu.text.stopword_lists.LANGUAGES` names it): the months
#: from January, then the weekdays from Monday, separated by spaces; a name's forms by ``/``.
DATE_NAMES: dict[str, str] = {
    "es": (
        "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre "
        "lunes martes miércoles jueves viernes sábado domingo"
    ),
    "fr": (
        "janvier février mars avril mai juin juillet août septembre octobre novembre décembre "
        "lundi mardi mercredi jeudi vendredi samedi dimanche"
    ),
    "de": (
        "januar februar märz april mai juni juli august september oktober november dezember "
        "montag dienstag mittwoch donnerstag freitag samstag sonntag"
    ),
    "pt": (
        "janeiro fevereiro março abril maio junho julho agosto setembro outubro novembro dezembro "
        "segunda terça quarta quinta sexta sábado domingo"
    ),
    "it": (
        "gennaio febbraio marzo aprile maggio giugno "
        "luglio agosto settembre ottobre novembre dicembre "
        "lunedì martedì mercoledì giovedì venerdì sabato domenica"
    ),
    "nl": (
        "januari februari maart april mei juni juli augustus september oktober november december "
        "maandag dinsdag woensdag donderdag vrijdag zaterdag zondag"
    ),
    "sv": (
        "januari februari mars april maj juni juli augusti september oktober november december "
        "måndag tisdag onsdag torsdag fredag lördag söndag"
    ),
    "da": (
        "januar februar marts april maj juni juli august september oktober november december "
        "mandag tirsdag onsdag torsdag fredag lørdag søndag"
    ),
    "nb": (
        "januar februar mars april mai juni juli august september oktober november desember "
        "mandag tirsdag onsdag torsdag fredag lørdag søndag"
    ),
    "fi": (
        "tammikuu/tammikuussa helmikuu/helmikuussa maaliskuu/maaliskuussa "
        "huhtikuu/huhtikuussa toukokuu/toukokuussa kesäkuu/kesäkuussa "
        "heinäkuu/heinäkuussa elokuu/elokuussa syyskuu/syyskuussa lokakuu/lokakuussa "
        "marraskuu/marraskuussa joulukuu/joulukuussa "
        "maanantai/maanantaina tiistai/tiistaina keskiviikko/keskiviikkona "
        "torstai/torstaina perjantai/perjantaina lauantai/lauantaina sunnuntai/sunnuntaina"
    ),
    "ca": (
        "gener febrer març abril maig juny juliol agost setembre octubre novembre desembre "
        "dilluns dimarts dimecres dijous divendres dissabte diumenge"
    ),
    "ro": (
        "ianuarie februarie martie aprilie mai iunie "
        "iulie august septembrie octombrie noiembrie decembrie "
        "luni marți miercuri joi vineri sâmbătă duminică"
    ),
    "pl": (
        "styczeń/stycznia/styczniu luty/lutego/lutym marzec/marca/marcu "
        "kwiecień/kwietnia/kwietniu maj/maja/maju czerwiec/czerwca/czerwcu "
        "lipiec/lipca/lipcu sierpień/sierpnia/sierpniu wrzesień/września/wrześniu "
        "październik/października/październiku listopad/listopada/listopadzie "
        "grudzień/grudnia/grudniu "
        "poniedziałek wtorek środa/środę czwartek piątek sobota/sobotę niedziela/niedzielę"
    ),
    "cs": (
        "leden/ledna/lednu únor/února/únoru březen/března/březnu duben/dubna/dubnu "
        "květen/května/květnu červen/června/červnu červenec/července/červenci "
        "srpen/srpna/srpnu září říjen/října/říjnu listopad/listopadu prosinec/prosince/prosinci "
        "pondělí úterý středa/středu čtvrtek pátek sobota/sobotu neděle/neděli"
    ),
    "sk": (
        "január/januára/januári február/februára/februári marec/marca/marci "
        "apríl/apríla/apríli máj/mája/máji jún/júna/júni júl/júla/júli "
        "august/augusta/auguste september/septembra/septembri október/októbra/októbri "
        "november/novembra/novembri december/decembra/decembri "
        "pondelok utorok streda/stredu štvrtok piatok sobota/sobotu nedeľa/nedeľu"
    ),
    "ru": (
        "январь/января/январе февраль/февраля/феврале март/марта/марте "
        "апрель/апреля/апреле май/мая/мае июнь/июня/июне июль/июля/июле "
        "август/августа/августе сентябрь/сентября/сентябре октябрь/октября/октябре "
        "ноябрь/ноября/ноябре декабрь/декабря/декабре "
        "понедельник вторник среда/среду четверг пятница/пятницу суббота/субботу воскресенье"
    ),
    "uk": (
        "січень/січня/січні лютий/лютого/лютому березень/березня/березні "
        "квітень/квітня/квітні травень/травня/травні червень/червня/червні "
        "липень/липня/липні серпень/серпня/серпні вересень/вересня/вересні "
        "жовтень/жовтня/жовтні листопад/листопада/листопаді грудень/грудня/грудні "
        "понеділок вівторок середа/середу четвер пятниця/пятницю/пʼятниця/пʼятницю субота/суботу "
        "неділя/неділю"
    ),
    "bg": (
        "януари февруари март април май юни юли август септември октомври ноември декември "
        "понеделник вторник сряда четвъртък петък събота неделя"
    ),
    "hu": (
        "január/januárban február/februárban március/márciusban április/áprilisban "
        "május/májusban június/júniusban július/júliusban augusztus/augusztusban "
        "szeptember/szeptemberben október/októberben november/novemberben "
        "december/decemberben "
        "hétfő/hétfőn kedd/kedden szerda/szerdán csütörtök/csütörtökön péntek/pénteken "
        "szombat/szombaton vasárnap"
    ),
    "tr": (
        "ocak/ocakta şubat/şubatta mart/martta nisan/nisanda mayıs/mayısta haziran/haziranda "
        "temmuz/temmuzda ağustos/ağustosta eylül/eylülde ekim/ekimde kasım/kasımda "
        "aralık/aralıkta "
        "pazartesi salı çarşamba perşembe cuma cumartesi pazar"
    ),
    "id": (
        "januari februari maret april mei juni juli agustus september oktober november desember "
        "senin selasa rabu kamis jumat sabtu minggu"
    ),
    "ms": (
        "januari februari mac april mei jun julai ogos september oktober november disember "
        "isnin selasa rabu khamis jumaat sabtu ahad"
    ),
}


def language_dates() -> list[list[str]]:
    """The native term splitter's table: by language list (``LANGUAGES`` order), its 19 date
    names, each its forms as the splitter reads words (normalised) joined by a space, or an
    empty list."""
    return [
        [
            " ".join(normalise(f) for f in name.split("/"))
            for name in DATE_NAMES.get(lang, "").split()
        ]
        for lang in LANGUAGES
    ]
